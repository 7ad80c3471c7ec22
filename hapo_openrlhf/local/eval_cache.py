"""A finished run's held-out evaluation, kept next to its final model and reused by a
run that starts from that model and would evaluate it again identically.

An experiment's RL runs all start from a shared warm start, and each would begin by
evaluating it (512 problems x 8 samples on the chain task: about 27 s a run on one
thread). The evaluation is a deterministic function of the weights, the evaluation
settings, the held-out problems and prompt template, the sampling seed (it samples under
a private RNG, so it leaves the training RNG untouched), the arithmetic (torch version
and intra-op thread count), and every other file of the model directory: ``config.json``
(``rms_norm_eps``, RoPE, the EOS id), the tokenizer files and ``generation_config.json``
(``repetition_penalty``, EOS) all change what generation produces. So
``final_model/eval.json`` records all of them with the metrics, and a run reuses the
metrics only when every one is equal and the metrics are what an evaluation writes (the
expected keys, finite numbers). Anything else (no file, another seed, an edited file, a
damaged or special file) means the run evaluates as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

FILE = "eval.json"


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the parameters' names, dtypes, shapes and bytes (the weights as loaded,
    so a saved-and-reloaded model has the digest of the model that was saved)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def problems_digest(problems) -> str:
    """sha256 over the held-out problems' texts and answers, in order."""
    return hashlib.sha256(json.dumps([[p.problem, p.answer] for p in problems]).encode()).hexdigest()


# the weights are covered by weights_digest (the tensors as loaded); eval.json is the cache itself
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
MAX_MODEL_FILE = 256 * 2**20  # config/tokenizer files; a tokenizer.json of a 150k vocabulary is ~10 MB


def files_digest(model_dir: str | Path) -> dict[str, str]:
    """sha256 of every file in a model directory but the weights and ``eval.json``:
    ``config.json``, ``generation_config.json``, the tokenizer files, ``hapo.json``.
    Read bounded: a link to a device or a FIFO there is an error, not a hang."""
    from ..rundir.jsonfile import read_small_bytes

    out = {}
    for f in sorted(Path(model_dir).iterdir()):
        if f.name == FILE or f.name.endswith(WEIGHT_SUFFIXES) or f.is_dir():
            continue
        out[f.name] = hashlib.sha256(read_small_bytes(f, "a model file", MAX_MODEL_FILE)).hexdigest()
    return out


def eval_key(model: torch.nn.Module, cfg, problems, eval_seed: int, model_dir: str | Path) -> dict[str, Any]:
    """Everything one held-out evaluation depends on; ``model_dir`` is the saved model
    directory (its config, tokenizer and generation files are part of the key)."""
    e = cfg.to_dict()["eval"]
    return {"weights_sha256": weights_digest(model), "files_sha256": files_digest(model_dir),
            "problems_sha256": problems_digest(problems),
            "template": cfg.data.template, "eval": e | {"seed": eval_seed},
            "torch": torch.__version__, "threads": torch.get_num_threads()}


# what evaluate() returns (local/evaluate.py); a cached file must have each, as a finite number
EXPECTED = ("eval/accuracy", "eval/response_len")


def _check_metrics(metrics: Any) -> dict[str, float]:
    if not isinstance(metrics, dict) or not metrics:
        raise ValueError("'metrics' is not a non-empty mapping of names to numbers")
    missing = [k for k in EXPECTED if k not in metrics]
    if missing:
        raise ValueError(f"'metrics' lacks {missing}")
    for k, v in metrics.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"metric {k!r} is {v!r}, not a finite number")
    return {k: float(v) for k, v in metrics.items()}


def dumps(key: dict[str, Any], metrics: dict[str, float]) -> str:
    return json.dumps({"key": key, "metrics": metrics}, indent=1, sort_keys=True)


def lookup(model_dir: str | Path, key: dict[str, Any]) -> dict[str, float] | None:
    """The metrics recorded in ``model_dir/eval.json`` when its key equals ``key`` and they
    are valid metrics, else None (with a log line saying why)."""
    from ..rundir.jsonfile import read_json_object

    f = Path(model_dir) / FILE
    if not f.exists() and not f.is_symlink():
        return None
    try:
        data = read_json_object(f, "cached evaluation")
        saved = data["key"]
        metrics = _check_metrics(data["metrics"])
    except (ValueError, KeyError, TypeError) as e:
        log.warning("ignoring %s (evaluating afresh): %s", f, e)
        return None
    if json.dumps(saved, sort_keys=True) != json.dumps(key, sort_keys=True):
        changed = sorted(k for k in set(saved) | set(key) if saved.get(k) != key.get(k)) if isinstance(saved, dict) else ["*"]
        log.info("not reusing %s: %s differ", f, ", ".join(changed))
        return None
    log.info("held-out evaluation of the starting model reused from %s (same weights, files, settings, data, seed)", f)
    return metrics
