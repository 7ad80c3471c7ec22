"""A finished run's held-out evaluation, kept next to its final model and reused by a
run that starts from that model and would evaluate it again identically.

An experiment's RL runs all start from a shared warm start, and each would begin by
evaluating it (512 problems x 8 samples on the chain task: about 27 s a run on one
thread). The evaluation is a deterministic function of the weights, the evaluation
settings, the held-out problems and prompt template, the sampling seed (it samples under
a private RNG, so it leaves the training RNG untouched) and the arithmetic (torch version
and intra-op thread count), so ``final_model/eval.json`` records all of them with the
metrics, and a run reuses the metrics only when every one is equal. Anything else (no
file, another seed, a damaged file) means the run evaluates as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
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


def eval_key(model: torch.nn.Module, cfg, problems, eval_seed: int) -> dict[str, Any]:
    """Everything one held-out evaluation depends on."""
    e = cfg.to_dict()["eval"]
    return {"weights_sha256": weights_digest(model), "problems_sha256": problems_digest(problems),
            "template": cfg.data.template, "eval": e | {"seed": eval_seed},
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def dumps(key: dict[str, Any], metrics: dict[str, float]) -> str:
    return json.dumps({"key": key, "metrics": metrics}, indent=1, sort_keys=True)


def lookup(model_dir: str | Path, key: dict[str, Any]) -> dict[str, float] | None:
    """The metrics recorded in ``model_dir/eval.json`` when its key equals ``key``, else None."""
    f = Path(model_dir) / FILE
    if not f.exists():
        return None
    try:
        data = json.loads(f.read_text())
        saved, metrics = data["key"], data["metrics"]
        if not (isinstance(metrics, dict) and metrics
                and all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in metrics.items())):
            raise ValueError("'metrics' is not a non-empty mapping of names to numbers")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring %s (evaluating afresh): %s", f, e)
        return None
    if json.dumps(saved, sort_keys=True) != json.dumps(key, sort_keys=True):
        changed = sorted(k for k in set(saved) | set(key) if saved.get(k) != key.get(k)) if isinstance(saved, dict) else ["*"]
        log.info("not reusing %s: %s differ", f, ", ".join(changed))
        return None
    log.info("held-out evaluation of the starting model reused from %s (same weights, settings, data, seed)", f)
    return {k: float(v) for k, v in metrics.items()}
