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

from ..config.model_files import HF_FIELDS, check_architecture, model_config_json  # noqa: F401
from ..data.tokenizer import EOS, PAD, UNK, build_tokenizer, load_tokenizer  # noqa: F401

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
        check_architecture(cfg, model_config_json(cfg.path))  # before the weights load
        tok = load_tokenizer(cfg.path)
        model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=torch.float32)
        return model, tok
    tok = build_tokenizer()
    return build_model(cfg, tok, seed), tok


def save_pretrained(model, path: str | Path) -> None:
    """``model.save_pretrained(path)``, without importing DeepSpeed for nothing. transformers
    first unwraps the model through accelerate's ``extract_model_from_parallel``, which, whenever
    DeepSpeed is installed (the ``openrlhf`` extra), imports DeepSpeed only to ask
    ``isinstance(model, DeepSpeedEngine)``: 1.5 s of CPU at the end of every embedded run, Slurm
    job and warm-up that never used DeepSpeed (issue 57). In a process that has not imported
    DeepSpeed no object is a DeepSpeed engine, so accelerate is told DeepSpeed is absent for the
    call and the answer is the same: the same files are written (tests/local/test_model_keys.py)."""
    import sys

    other = sys.modules.get("accelerate.utils.other")
    if other is None:  # transformers imports accelerate's utils with the model when accelerate is installed
        try:
            import accelerate.utils.other as other
        except ImportError:
            other = None
    if other is None or "deepspeed" in sys.modules or not hasattr(other, "is_deepspeed_available"):
        model.save_pretrained(str(path))
        return
    real = other.is_deepspeed_available
    other.is_deepspeed_available = lambda: False
    try:
        model.save_pretrained(str(path))
    finally:
        other.is_deepspeed_available = real


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
    save_pretrained(model, tmp)
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
