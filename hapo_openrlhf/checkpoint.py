"""Atomic, sharded checkpoints with latest-complete discovery.

Layout::

    ckpt_root/
      step_00000010/            one directory per checkpoint
        shard_rank00000.pt      each rank's own state (model, optimizer, RNG, ...)
        meta.json               written last inside the temp dir: marks it complete
      latest                    text file naming the newest complete directory

A save writes into ``.tmp-step_...`` (fsynced), renames it into place, then
rewrites ``latest`` via ``os.replace``. A crash at any point leaves the previous
checkpoint and pointer intact; a directory without ``meta.json`` is ignored.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_RE = re.compile(r"^step_(\d{8})$")
META = "meta.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def shard_name(rank: int) -> str:
    return f"shard_rank{rank:05d}.pt"


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str | Path, step: int, shards: dict[int, dict[str, Any]], meta: dict[str, Any], keep_last: int = 2
) -> Path:
    """Write ``shards`` (rank -> state) for ``step`` atomically; returns the final dir.

    On one process all shards are written here; a distributed back end calls it
    per rank with ``{rank: state}`` into a shared temp dir and lets rank 0 finish.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for rank, state in shards.items():
        p = tmp / shard_name(rank)
        torch.save(state, p)
        _fsync_file(p)
    meta = {**meta, "step": step, "world_size": len(shards), "saved_at": time.time()}
    (tmp / META).write_text(json.dumps(meta, indent=2, default=str))
    _fsync_file(tmp / META)
    _fsync_dir(tmp)
    if final.exists():  # re-saving a step (e.g. after a resume): replace it
        old = root / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync_dir(root)
    pointer_tmp = root / f".latest-{os.getpid()}"
    pointer_tmp.write_text(final.name + "\n")
    _fsync_file(pointer_tmp)
    os.replace(pointer_tmp, root / "latest")
    _fsync_dir(root)
    _prune(root, keep_last)
    return final


def _complete(d: Path) -> bool:
    try:
        json.loads((d / META).read_text())
        return True
    except (OSError, ValueError):
        return False


def list_complete(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and _STEP_RE.match(d.name) and _complete(d)]
    return sorted(dirs, key=lambda d: int(_STEP_RE.match(d.name).group(1)))


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest *complete* checkpoint dir: the ``latest`` pointer when it names a
    complete one, else the highest complete step; None if there is none."""
    root = Path(root)
    done = list_complete(root)
    pointer = root / "latest"
    if pointer.exists():
        cand = root / pointer.read_text().strip()
        if cand in done and cand == done[-1]:
            return cand
    return done[-1] if done else None


def load_checkpoint(ckpt_dir: str | Path, rank: int = 0, world_size: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shard state, meta) for ``rank``; a different world size is a clear error."""
    d = Path(ckpt_dir)
    if not _complete(d):
        raise ValueError(f"checkpoint {str(d)!r} is missing or incomplete (no readable {META})")
    meta = json.loads((d / META).read_text())
    if meta.get("world_size", 1) != world_size:
        raise ValueError(
            f"checkpoint {str(d)!r} was saved by {meta['world_size']} rank(s) but this run has "
            f"{world_size}; resume with the same data-parallel size"
        )
    state = torch.load(d / shard_name(rank), map_location="cpu", weights_only=False)
    return state, meta


def _prune(root: Path, keep_last: int) -> None:
    done = list_complete(root)
    for d in done[:-keep_last]:
        shutil.rmtree(d, ignore_errors=True)
    for d in root.iterdir():  # temp dirs left by crashed saves of other processes
        if d.name.startswith((".tmp-", ".old-")) and not d.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(d, ignore_errors=True)
