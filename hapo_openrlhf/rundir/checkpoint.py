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

Shards are read with PyTorch's restricted unpickler (:func:`safe_torch_load`), so a
planted or tampered shard cannot run code on resume: the CRC-32 in ``meta.json`` is written
by whoever writes the checkpoint and guards against accidents, not against an attacker.

``meta.json`` records every shard's size and CRC-32; :func:`verify_checkpoint` checks
them before a resume uses the directory, and :func:`resumable_checkpoints` scans the
step directories newest first (``latest`` is advisory), skipping -- with a warning --
any that fails, so a truncated or overwritten newest shard falls back to the newest
older checkpoint that verifies.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_RE = re.compile(r"^step_(\d{8})$")
META = "meta.json"
log = logging.getLogger(__name__)


def file_crc32(path: Path, chunk: int = 8 << 20) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


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
    """Every generator's state in types ``torch.load(weights_only=True)`` reads: numpy's
    key array travels as a tensor, the rest as ints, floats and strings."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((name, keys.astype(np.uint32), pos, has_gauss, cached))
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
    files = {}
    for rank, state in shards.items():
        p = tmp / shard_name(rank)
        try:
            torch.save(state, p)
        except RuntimeError as e:  # torch reports ENOSPC and EFBIG alike as a bare "iostream error"
            raise _write_error(e, p, root) from None
        _fsync_file(p)
        files[p.name] = {"size": p.stat().st_size, "crc32": file_crc32(p)}
    meta = {**meta, "step": step, "world_size": len(shards), "saved_at": time.time(), "files": files}
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


def _read_meta(d: Path) -> dict[str, Any]:
    """``d/meta.json`` as a mapping; ``ValueError`` naming what is wrong otherwise."""
    try:
        meta = json.loads((d / META).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{META} unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{META} holds a JSON {type(meta).__name__}, not an object")
    files = meta.get("files")
    if files is not None and not (isinstance(files, dict) and all(
            isinstance(w, dict) and isinstance(w.get("size"), int) and isinstance(w.get("crc32"), int)
            for w in files.values())):
        raise ValueError(f"{META}: 'files' must map each shard to its size and crc32, got {str(files)[:80]}")
    ws = meta.get("world_size", 1)
    if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
        raise ValueError(f"{META}: world_size must be an integer >= 1, got {ws!r}")
    return meta


def _write_error(e: Exception, path: Path, root: Path) -> OSError:
    """What most likely stopped ``torch.save``: a file-size limit (``ulimit -f``, which Python
    turns from SIGXFSZ into EFBIG) when the shard reached it, else a full disk."""
    import errno
    import resource

    free = shutil.disk_usage(root).free
    written = path.stat().st_size if path.exists() else 0
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and written >= limit:
        return OSError(errno.EFBIG, f"could not write the checkpoint shard ({e}): it reached this process's file-size "
                                    f"limit of {limit} bytes (ulimit -f); {free / 2**20:.0f} MiB are free on the "
                                    f"filesystem, so raise the limit", str(path))
    return OSError(errno.ENOSPC, f"could not write the checkpoint shard ({e}); {free / 2**20:.0f} MiB free on its "
                                 f"filesystem -- most likely a full disk", str(path))


def _complete(d: Path) -> bool:
    """A ``meta.json`` exists (it is written last); whether it is sound is :func:`verify_checkpoint`'s."""
    return (d / META).is_file()


def list_complete(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and _STEP_RE.match(d.name) and _complete(d)]
    return sorted(dirs, key=lambda d: int(_STEP_RE.match(d.name).group(1)))


def verify_checkpoint(d: str | Path) -> str | None:
    """None when every shard ``meta.json`` lists is there with its recorded size and CRC-32;
    else the reason. (A checkpoint written before the manifest existed is taken on its meta.)"""
    d = Path(d)
    try:
        meta = _read_meta(d)
    except ValueError as e:
        return str(e)
    for name, want in (meta.get("files") or {}).items():
        p = d / name
        if not p.is_file():
            return f"{name} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, {want['size']} were written (truncated or overwritten)"
        if file_crc32(p) != want["crc32"]:
            return f"{name} does not match its CRC-32 (corrupted or overwritten)"
    if not meta.get("files") and not (d / shard_name(0)).is_file():
        return f"{shard_name(0)} is missing"
    return None


def resumable_checkpoints(root: str | Path) -> tuple[list[Path], list[str]]:
    """(complete checkpoints that verify, newest first; one line per one that does not).
    The step directories are scanned: the ``latest`` pointer is advisory (a torn or
    garbage pointer changes nothing)."""
    good, bad = [], []
    for d in reversed(list_complete(root)):
        why = verify_checkpoint(d)
        if why is None:
            good.append(d)
        else:
            bad.append(f"{d}: {why}")
    return good, bad


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint dir that is complete and verifies (warning about newer ones
    that do not); None if there is none. Raises when checkpoints exist but none verifies."""
    good, bad = resumable_checkpoints(root)
    for line in bad:
        log.warning("skipping checkpoint %s", line)
    if not good and bad:
        raise ValueError("no checkpoint verifies; tried, newest first:\n  " + "\n  ".join(bad))
    return good[0] if good else None


def load_checkpoint(ckpt_dir: str | Path, rank: int = 0, world_size: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shard state, meta) for ``rank``; a different world size is a clear error."""
    d = Path(ckpt_dir)
    if not _complete(d):
        raise ValueError(f"checkpoint {str(d)!r} is missing or incomplete (no readable {META})")
    try:
        meta = _read_meta(d)
    except ValueError as e:
        raise ValueError(f"checkpoint {str(d)!r}: {e}") from None
    if meta.get("world_size", 1) != world_size:
        raise ValueError(
            f"checkpoint {str(d)!r} was saved by {meta['world_size']} rank(s) but this run has "
            f"{world_size}; resume with the same data-parallel size"
        )
    state = safe_torch_load(d / shard_name(rank))
    return state, meta


class UnsafeCheckpoint(ValueError):
    """A checkpoint file holds something other than tensors and plain containers."""


# What an older hapo checkpoint holds beyond tensors and plain containers: numpy's RNG key
# array (``np.random.get_state()`` pickled as an ndarray). Rebuilding an ndarray of a numeric
# dtype runs no code; an object dtype is refused by the restricted unpickler all the same,
# because its elements would need globals outside this list.
def _numpy_globals() -> list:
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def safe_torch_load(path: str | Path) -> Any:
    """``torch.load`` that never runs code from the file: PyTorch's restricted
    (``weights_only``) unpickler, which builds tensors, numbers, strings and containers
    and refuses every other global -- a ``__reduce__`` pointing at ``os.system`` included.
    A file that needs anything else is refused with :class:`UnsafeCheckpoint`, naming it."""
    import pickle

    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "an unsupported object"
        raise UnsafeCheckpoint(
            f"{path} holds objects other than tensors and plain data, and is not loaded (loading it could run "
            f"code): {first[:300]}. hapo never writes such files; if this one is your own, load it yourself "
            f"with torch.load(weights_only=False) and save its tensors again") from None


def _prune(root: Path, keep_last: int) -> None:
    done = list_complete(root)
    for d in done[:-keep_last]:
        shutil.rmtree(d, ignore_errors=True)
    for d in root.iterdir():  # temp dirs left by crashed saves of other processes
        if d.name.startswith((".tmp-", ".old-")) and not d.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(d, ignore_errors=True)
