"""Megatron distributed (sharded) checkpoints of the model, a torch optimizer's
state and the trainer state, written atomically.

Every rank writes its own shards through ``megatron.core.dist_checkpointing``
(the ``torch_dist`` format: resharding on load is Megatron's). Optimizer moments
are saved as sharded tensors laid out like their parameters
(``optim_state_to_sharding_state``); the step count and the trainer state
(step, data position, RNG, ...) are common state written once. A checkpoint is
written to ``step_N.tmp/`` and renamed to ``step_N/`` by rank 0 after every rank
has finished, so a directory named ``step_N`` is always complete; a crash mid-save
leaves only a ``.tmp`` directory, which ``latest`` ignores. Before the rename rank 0
writes ``hapo_manifest.json``: every file's size, and the CRC-32 of each file up to
64 MiB (Megatron's metadata and common state; the large tensor shards are sized, not
read back). ``latest`` returns the newest directory that matches its manifest, warning
about newer ones that do not (a truncated shard, a missing file).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .safe_load import scan

_STEP = re.compile(r"^step_(\d+)$")
MANIFEST = "hapo_manifest.json"
CRC_MAX_BYTES = 64 << 20
log = logging.getLogger(__name__)


def write_manifest(d: Path) -> None:
    from ..checkpoint import file_crc32

    files = {}
    for f in sorted(p for p in d.rglob("*") if p.is_file() and p.name != MANIFEST):
        size = f.stat().st_size
        files[str(f.relative_to(d))] = {"size": size, **({"crc32": file_crc32(f)} if size <= CRC_MAX_BYTES else {})}
    tmp = d / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": files}))
    os.replace(tmp, d / MANIFEST)


def verify(d: Path) -> str | None:
    """None when ``d`` matches its manifest (a checkpoint without one is taken as is)."""
    from ..checkpoint import file_crc32

    m = d / MANIFEST
    if not m.exists():
        return None
    try:
        files = json.loads(m.read_text())["files"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"{MANIFEST} is unreadable or not a JSON object with 'files' ({str(e)[:100]})"
    if not isinstance(files, dict) or not all(
            isinstance(n, str) and isinstance(w, dict) and isinstance(w.get("size"), int)
            and isinstance(w.get("crc32", 0), int) for n, w in files.items()):
        return f"{MANIFEST} is malformed ('files' must map each file name to its integer size and CRC-32)"
    for name, want in files.items():
        f = d / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"{MANIFEST} names a file outside the checkpoint ({name!r})"
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["size"]:
            return f"{name} has {f.stat().st_size} bytes, {want['size']} were written (truncated or overwritten)"
        if "crc32" in want and file_crc32(f) != want["crc32"]:
            return f"{name} does not match its CRC-32"
    return scan(d)  # the CRC-32 guards against accidents; this against a planted pickle


def latest(root: str | Path) -> Path | None:
    """The newest complete checkpoint directory under ``root`` that matches its manifest
    (None if there is none); newer ones that do not are skipped with a warning, and when
    none matches the error lists them."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()),
                   reverse=True)
    bad = []
    for _, p in found:
        why = verify(p)
        if why is None:
            return p
        log.warning("skipping Megatron checkpoint %s: %s", p, why)
        bad.append(f"{p}: {why}")
    if bad:
        raise ValueError("no Megatron checkpoint verifies; tried, newest first:\n  " + "\n  ".join(bad))
    return None


def _sharded(model, optimizer, trainer_state: dict[str, Any] | None, model_params=None):
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model_sd = model.sharded_state_dict()
    out: dict[str, Any] = {"model": model_sd, "trainer": trainer_state or {}}
    if optimizer is not None:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        mparams = params if model_params is None else list(model_params)
        masters = any(a is not b for a, b in zip(params, mparams, strict=True))
        osd = optimizer.state_dict()
        # a fresh optimizer has no state yet: give it zero moments to load into
        for i, p in enumerate(params):
            if i not in osd["state"]:
                osd["state"][i] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                                   "step": torch.zeros(())}
            if masters:  # fp32 master weights, sharded like the model parameter they shadow
                osd["state"][i]["master"] = p.detach()
        steps = {i: float(s.get("step", 0)) for i, s in osd["state"].items()}
        id_map = get_param_id_to_sharded_param_map(model_sd, mparams)
        optim_state_to_sharding_state(osd, id_map, exclude_keys=("step",))
        out["optimizer"] = osd
        out["optimizer_step"] = max(steps.values(), default=0.0)
    return out


def save(root: str | Path, step: int, model, optimizer=None, trainer_state: dict[str, Any] | None = None,
         model_params=None) -> Path:
    """Write ``root/step_{step}`` from every rank of the job (a collective call). When the
    optimizer steps fp32 master copies (``optim.MainParams``), pass the model parameters
    they shadow, in the optimizer's order, as ``model_params``: the masters are saved too."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if dist.get_rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(model, optimizer, trainer_state, model_params), str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier()
    return final


def load(path: str | Path, model, optimizer=None, model_params=None) -> dict[str, Any]:
    """Load a checkpoint written by ``save`` into ``model`` (and ``optimizer``, with its
    fp32 masters when ``model_params`` is given); returns the trainer state. The tensor
    parallel size may differ from the one that saved it (Megatron reshards on load)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not path.is_dir() or path.name.endswith(".tmp"):
        raise ValueError(f"{str(path)!r} is not a complete checkpoint directory")
    why = scan(path)
    if why:
        raise ValueError(f"checkpoint {str(path)!r} is not loaded: {why}")
    sharded = _sharded(model, optimizer, {}, model_params)
    state = dist_checkpointing.load(sharded, str(path))
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    bad = [k for k in missing if not k.endswith("_extra_state")] + list(unexpected)
    if bad:
        raise ValueError(f"checkpoint {str(path)!r} does not match the model: {bad[:5]}")
    if optimizer is not None:
        osd = state["optimizer"]
        step = torch.tensor(float(state["optimizer_step"]))
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for i, s in osd["state"].items():
            s["step"] = step.clone()
            master = s.pop("master", None)
            if master is not None:
                with torch.no_grad():
                    params[i].copy_(master)
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": osd["state"], "param_groups": groups})
    return state["trainer"]
