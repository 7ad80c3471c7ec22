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


# ModelConfig key -> the Hugging Face config.json field it describes
HF_FIELDS = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size",
             "max_position_embeddings": "max_position_embeddings", "tie_word_embeddings": "tie_word_embeddings",
             "family": "model_type"}


def model_config_json(path: str | Path) -> dict:
    """``path/config.json`` as a dict (a named error for a missing or damaged one)."""
    from ..rundir.jsonfile import read_json_object

    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"model.path {str(path)!r} has no config.json (not a Hugging Face model directory)")
    return read_json_object(f, "the model's config")


def check_architecture(cfg, hf_config: dict) -> None:
    """With ``model.path`` set, every architecture key the run config states (``model.family``,
    ``model.hidden_size``, ...) must describe the model at that path: it cannot change a
    trained model, and silently ignoring it would record an architecture in ``config.yaml``
    that the run did not have. Refused by name, with both values."""
    wrong = []
    for key, value in cfg.architecture_given().items():
        field = HF_FIELDS[key]
        have = hf_config.get(field)
        if key == "num_kv_heads" and have is None:  # absent in config.json: as many as attention heads
            have = hf_config.get("num_attention_heads")
        if key == "tie_word_embeddings" and have is None:
            have = True  # transformers' PretrainedConfig default
        if have != value:
            wrong.append(f"model.{key}: {value!r} but the model's config.json has {field}: {have!r}")
    if wrong:
        raise ValueError(f"model.path {cfg.path!r} holds another architecture than the config states ("
                         + "; ".join(wrong) + "); model keys cannot change a saved model: remove them, or "
                         "point model.path at a model that has them")


def load_or_build(cfg, seed: int):
    """(model, tokenizer): from ``cfg.path`` when set, else the tiny model + char tokenizer."""
    if cfg.path:
        from transformers import AutoModelForCausalLM

        if not Path(cfg.path).exists():
            raise ValueError(f"model.path {cfg.path!r} does not exist (hub downloads are not used)")
        check_architecture(cfg, model_config_json(cfg.path))  # before the weights load
        tok = load_tokenizer(cfg.path)
        model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=torch.float32)
        return model, tok
    tok = build_tokenizer()
    return build_model(cfg, tok, seed), tok


def save_hf(model, tokenizer, path: str | Path, extra_files: dict[str, str] | None = None,
            finalize=None) -> None:
    """A Hugging Face model directory, written like a checkpoint: into a temp directory,
    fsynced, then renamed into place (replacing an older one), so a kill never leaves
    weights without a tokenizer at ``path``. ``finalize(tmp_dir)``, when given, is called
    once everything else is written and returns more files {name: text} (files derived from
    the written ones, e.g. eval.json's digests)."""
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
    for name, text in (finalize(tmp) if finalize else {}).items():
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
