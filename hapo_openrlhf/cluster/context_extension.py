"""A model directory with its context extended by YaRN, as Qwen's model cards ask for it: the
same weights (symbolic links, nothing copied), a ``config.json`` that adds

    "rope_scaling": {"rope_type": "yarn", "factor": F, "original_max_position_embeddings": N}

(Qwen3-8B: factor 4 over 32,768 positions = 131,072). vLLM, transformers and the Megatron
actor (``megatron/families.yarn_settings``) all read YaRN from that file, so the rollout, the
reference and the policy use the same positions; OpenRLHF has no other way to pass it to its
engines. ``max_position_embeddings`` is kept as published (vLLM derives the longest context from
it times the factor; transformers and megatron-core take the factor given).

    hapo extend-context Qwen/Qwen3-8B-Base models/Qwen3-8B-Base-yarn4 --factor 4

The source is a local directory or a hub id already in the local Hugging Face cache (this
writes nothing to the cache and downloads nothing).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _source_dir(src: str) -> Path:
    local = Path(src).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ValueError(f"{src}: a directory without config.json is not a model directory")
        return local.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(src, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - not cached, not a hub id
        raise ValueError(f"{src}: not a local model directory and not in the local Hugging Face cache "
                         f"(download it first: huggingface-cli download {src})") from e


def extend_context(src: str, dst: str, *, factor: float, original: int | None = None) -> Path:
    """Write ``dst``: every entry of the model directory ``src`` linked, ``config.json`` rewritten with
    YaRN by ``factor`` over ``original`` positions (default: the model's ``max_position_embeddings``).
    Refuses a model already scaled, a factor that does not extend, and a ``dst`` that holds anything."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor <= 1:
        raise ValueError(f"--factor must be a number > 1 (the context's stretch), got {factor!r}")
    source = _source_dir(src)
    cfg = json.loads((source / "config.json").read_text())
    scaled = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaled.get("rope_type", scaled.get("type", "default")) if isinstance(scaled, dict) else "?"
    if kind not in ("default", None):
        raise ValueError(f"{src}: config.json already scales RoPE ({kind!r}): extend the unscaled model")
    n = original if original is not None else cfg.get("max_position_embeddings")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"--original must be the model's pretraining context in positions (an integer >= 1), got {n!r}")
    out = Path(dst).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{dst} exists and is not an empty directory: choose a new one")
    out.mkdir(parents=True, exist_ok=True)
    for entry in sorted(source.iterdir()):
        if entry.name != "config.json":
            (out / entry.name).symlink_to(entry.resolve())
    rope = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(n)}
    if isinstance(scaled, dict) and "rope_theta" in scaled:  # transformers 5 keeps theta in rope_parameters
        rope["rope_theta"] = scaled["rope_theta"]
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = rope
    tmp = out / ".config.json.tmp"
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    os.replace(tmp, out / "config.json")
    return out
