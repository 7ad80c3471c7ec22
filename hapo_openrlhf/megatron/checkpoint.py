"""Megatron distributed (sharded) checkpoints of the model, Megatron's optimizer
(``ddp.MegatronOptimizer``) and the trainer state, written atomically.

Every rank writes its own shards through ``megatron.core.dist_checkpointing``
(the ``torch_dist`` format: resharding on load is Megatron's). The optimizer's state is
its own ``sharded_state_dict``: the distributed optimizer's in the sharding type it was
built with (``dp_reshardable``: each rank's buffer shards, resumable at another DP size
only; ``fully_reshardable``: per-parameter tensors, resumable under any TP x PP x DP),
the replicated optimizer's per parameter, laid out like the model. The trainer state
(step, data position, scheduler, ...) is common state written once. ``hapo_layout.json``
records the layout and optimizer format that wrote the checkpoint; :func:`load` refuses,
by name, a resume the format cannot make (before reading any tensor). A checkpoint is
written to ``step_N.tmp/`` and renamed to ``step_N/`` by rank 0 after every rank
has finished, so a directory named ``step_N`` is always complete; a crash mid-save
leaves only a ``.tmp`` directory, which ``latest`` ignores. Before the rename rank 0
writes ``hapo_manifest.json``: every file's size, and the CRC-32 of each file up to
64 MiB (Megatron's metadata and common state; the large tensor shards are sized, not
read back). ``latest`` returns the newest directory that matches its manifest, warning
about newer ones that do not (a truncated shard, a missing file). A save is synchronous and starts
no process of its own (:func:`_in_process_results_queue`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .safe_load import scan

_STEP = re.compile(r"^step_(\d+)$")
MANIFEST = "hapo_manifest.json"
CRC_MAX_BYTES = 64 << 20
log = logging.getLogger(__name__)


def write_manifest(d: Path) -> None:
    from ..rundir.checkpoint import file_crc32

    files = {}
    for f in sorted(p for p in d.rglob("*") if p.is_file() and p.name != MANIFEST):
        size = f.stat().st_size
        files[str(f.relative_to(d))] = {"size": size, **({"crc32": file_crc32(f)} if size <= CRC_MAX_BYTES else {})}
    tmp = d / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": files}))
    os.replace(tmp, d / MANIFEST)


def verify(d: Path) -> str | None:
    """None when ``d`` matches its manifest (a checkpoint without one is taken as is)."""
    from ..rundir.checkpoint import file_crc32

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


LAYOUT = "hapo_layout.json"


def _stage(model):
    """The GPTModel stage inside Megatron's DDP wrapper (or ``model`` itself)."""
    return model.module if hasattr(model, "ddp_config") else model


def _layout(optimizer) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from .compat import installed

    return {"tensor_parallel": ps.get_tensor_model_parallel_world_size(),
            "pipeline_parallel": ps.get_pipeline_model_parallel_world_size(),
            "data_parallel": ps.get_data_parallel_world_size(),
            "expert_parallel": ps.get_expert_model_parallel_world_size(),
            "context_parallel": ps.get_context_parallel_world_size(),
            "optimizer": optimizer.checkpoint_format if optimizer is not None else None,
            "megatron_core": installed()}


def check_resumable(path: Path, optimizer) -> None:
    """Refuse, naming the reason, a checkpoint this optimizer, layout and megatron-core
    cannot resume."""
    from .compat import check_checkpoint_version

    here = _layout(optimizer)
    f = path / LAYOUT
    if not f.is_file():
        if optimizer is not None:
            raise ValueError(f"checkpoint {str(path)!r} has no {LAYOUT}: it was written before hapo used Megatron's "
                             f"optimizer (torch AdamW state) and its optimizer state cannot be resumed; start from its "
                             f"weights instead (convert them to Hugging Face layout)")
        return
    try:
        saved = json.loads(f.read_text())
        fmt = saved["optimizer"]
        shape = {k: int(saved[k]) for k in ("tensor_parallel", "pipeline_parallel", "data_parallel")}
        shape["expert_parallel"] = int(saved.get("expert_parallel", 1))  # absent: written before MoE (EP 1)
        shape["context_parallel"] = int(saved.get("context_parallel", 1))  # absent: written before CP (CP 1)
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise ValueError(f"checkpoint {str(path)!r}: {LAYOUT} is unreadable ({str(e)[:100]})") from None
    check_checkpoint_version(path, saved.get("megatron_core"))  # a dict: saved["optimizer"] was read
    if optimizer is None:
        return
    if fmt is None:
        raise ValueError(f"checkpoint {str(path)!r} holds no optimizer state (saved without an optimizer)")
    if fmt != here["optimizer"]:
        raise ValueError(
            f"checkpoint {str(path)!r} (TP {shape['tensor_parallel']} x PP {shape['pipeline_parallel']} x DP "
            f"{shape['data_parallel']}) holds optimizer state in the format {fmt!r} but this run's optimizer "
            f"(TP {here['tensor_parallel']} x PP {here['pipeline_parallel']} x DP {here['data_parallel']}) is "
            f"{here['optimizer']!r}: resume with the same megatron.distributed_optimizer and "
            f"megatron.optimizer_sharding as the run that saved it (distributed_optimizer: null picks the "
            f"distributed optimizer only at DP > 1; set it to true in both runs to move between DP 1 and DP > 1)")
    if fmt == "distributed/dp_reshardable":
        # each rank's flat buffer shards: which parameters (and which experts) a buffer holds is fixed by
        # TP, PP and EP, so only the data-parallel size may change -- and the context-parallel size: the
        # distributed optimizer shards over DP x CP, whose ranks hold the same parameters
        moved = [k for k in ("tensor_parallel", "pipeline_parallel", "expert_parallel") if shape[k] != here[k]]
        if moved:
            raise ValueError(
                f"checkpoint {str(path)!r} was saved with megatron.optimizer_sharding: dp_reshardable at TP "
                f"{shape['tensor_parallel']} x PP {shape['pipeline_parallel']} x EP {shape['expert_parallel']}, "
                f"which can resume at another data-parallel size only, not at TP {here['tensor_parallel']} x PP "
                f"{here['pipeline_parallel']} x EP {here['expert_parallel']} (save with optimizer_sharding: "
                f"fully_reshardable to change {' and '.join(moved)})")


def _sharded(model, optimizer, trainer_state: dict[str, Any] | None, *, is_loading: bool) -> dict[str, Any]:
    model_sd = _stage(model).sharded_state_dict()
    out: dict[str, Any] = {"model": model_sd, "trainer": trainer_state or {}}
    if optimizer is not None:
        out["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return out


@contextlib.contextmanager
def _in_process_results_queue():
    """megatron-core's writer (``FileSystemWriterAsync``, its writer for synchronous saves too) takes
    its results queue from a ``Manager`` of the ``spawn`` context it starts on a rank's first save: a
    fresh interpreter per rank (measured 1.8-2.3 s of CPU each under the tests' ranks), which re-imports
    the rank's ``__main__``, for a queue a synchronous save fills and empties in the saving process
    itself (``AsyncRequest.execute_sync`` runs ``write_preloaded_data_multiproc`` here, then
    ``retrieve_write_results`` reads it here). For the duration of this (synchronous) save an
    in-process queue stands in; the module's ``None`` is put back after, so an asynchronous save
    anyone makes later still gets its Manager. Left as is where megatron-core made one already or
    keeps no such module global (0.16.1-0.19.2 all keep ``_results_queue``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:
        yield
        return
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = None


def save(root: str | Path, step: int, model, optimizer=None, trainer_state: dict[str, Any] | None = None) -> Path:
    """Write ``root/step_{step}`` from every rank of the job (a collective call): the model
    stage, ``optimizer`` (a ``ddp.MegatronOptimizer``: its fp32 masters and moments) and
    ``trainer_state``."""
    from megatron.core import dist_checkpointing

    root = Path(root)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if dist.get_rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    with _in_process_results_queue():
        dist_checkpointing.save(_sharded(model, optimizer, trainer_state, is_loading=False), str(tmp))
    layout = _layout(optimizer)
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / LAYOUT).write_text(json.dumps(layout))
        write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    dist.barrier()
    return final


def load(path: str | Path, model, optimizer=None) -> dict[str, Any]:
    """Load a checkpoint written by ``save`` into ``model`` (and ``optimizer``); returns
    the trainer state. The model reshards on load under any TP x PP (Megatron's); the
    optimizer state as its format allows (:func:`check_resumable` refuses the rest)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not path.is_dir() or path.name.endswith(".tmp"):
        raise ValueError(f"{str(path)!r} is not a complete checkpoint directory")
    why = scan(path)
    if why:
        raise ValueError(f"checkpoint {str(path)!r} is not loaded: {why}")
    check_resumable(path, optimizer)
    from megatron.core.dist_checkpointing.validation import StrictHandling

    # what the model asks for and the checkpoint lacks is left out of the load and returned: a
    # Transformer Engine module's (fp8-only) extra state may be absent -- a checkpoint of the local
    # layer spec, which names every tensor as the TE spec does, loads into the TE spec -- anything else
    # is refused by name
    state, _, absent = dist_checkpointing.load(_sharded(model, optimizer, {}, is_loading=True), str(path),
                                               strict=StrictHandling.RETURN_UNEXPECTED)
    absent = sorted(k for k in absent if not k.endswith("_extra_state"))
    if absent:
        raise ValueError(f"checkpoint {str(path)!r} does not hold {len(absent)} tensors this model needs "
                         f"(another model or layer layout?): {absent[:5]}")
    missing, unexpected = _stage(model).load_state_dict(state["model"], strict=False)
    bad = [k for k in missing if not k.endswith("_extra_state")] + list(unexpected)
    if bad:
        raise ValueError(f"checkpoint {str(path)!r} does not match the model: {bad[:5]}")
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    return state["trainer"]
