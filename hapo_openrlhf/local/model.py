"""The embedded default's tiny model (Qwen2 architecture by default; Qwen3 or Llama by
``model.family``) and character tokenizer.

The tokenizer is a byte-level ``tokenizers`` BPE with no merges: one token per
UTF-8 byte, deterministic, nothing to download. Both are saved as a
normal Hugging Face directory, so every other tool (eval, OpenRLHF, vLLM) can
load the result by path.
"""

from __future__ import annotations

from pathlib import Path

import torch

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"


def build_tokenizer():
    """One token per UTF-8 byte: a byte-level BPE without merges.

    Byte-level (Qwen2 / GPT-2 style) rather than plain characters because
    ``AutoTokenizer`` on a ``qwen2`` model directory rebuilds a Qwen2 tokenizer
    (byte-level pre-tokenizer and decoder) around the saved vocabulary: with
    this vocabulary every loader (ours, transformers, vLLM, OpenRLHF) splits
    text identically.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate([PAD, EOS, UNK, *alphabet])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


# model.family: the Hugging Face architecture of the tiny model (head_dim = hidden / heads)
FAMILIES = ("qwen2", "qwen3", "llama")


def build_model(cfg, tokenizer, seed: int):
    """A randomly initialised causal LM from ``ModelConfig`` (fp32, CPU): Qwen2 (the
    default, the paper's architecture), Qwen3 (QK-norm, no QKV bias) or Llama, by
    ``cfg.family``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    family = getattr(cfg, "family", "qwen2")
    kinds = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}
    if family not in kinds:
        raise ValueError(f"model.family must be one of {FAMILIES}, got {family!r}")
    extra = {} if family == "qwen2" else {"head_dim": cfg.hidden_size // cfg.num_heads}
    qcfg = kinds[family](
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **extra,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(qcfg)
    model.config.use_cache = True
    return model


def load_or_build(cfg, seed: int):
    """(model, tokenizer): from ``cfg.path`` when set, else the tiny model + char tokenizer."""
    if cfg.path:
        from transformers import AutoModelForCausalLM

        if not Path(cfg.path).exists():
            raise ValueError(f"model.path {cfg.path!r} does not exist (hub downloads are not used)")
        tok = load_tokenizer(cfg.path)
        model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=torch.float32)
        return model, tok
    tok = build_tokenizer()
    return build_model(cfg, tok, seed), tok


def save_hf(model, tokenizer, path: str | Path, extra_files: dict[str, str] | None = None) -> None:
    """A Hugging Face model directory, written like a checkpoint: into a temp directory,
    fsynced, then renamed into place (replacing an older one), so a kill never leaves
    weights without a tokenizer at ``path``."""
    import os
    import shutil

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if path.exists():
        old = path.parent / f".old-{path.name}-{os.getpid()}"
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(path)
    fd = os.open(str(path.parent), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
