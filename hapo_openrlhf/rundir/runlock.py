"""One owner per run directory: an exclusive ``flock`` on ``OUTPUT_DIR/.hapo.lock``.

``hapo train`` (fresh or ``--resume``), the OpenRLHF/Megatron driver and the Slurm job
take it before writing anything; the kernel releases it when the process exits, also on
a crash or SIGKILL, so a stale lock never blocks a requeue. A second process gets an
error naming the holder's PID, host and command. The Slurm job holds the lock for the
trainer it starts (``HAPO_RUN_LOCK_HELD`` tells the child), and a process may take the
same directory's lock more than once (re-entrant).

The lock file is opened with ``O_NOFOLLOW`` and must be a regular file: a symlink planted
at ``.hapo.lock`` in a shared run directory is refused, never followed (it would make the
next run truncate and overwrite whatever file it points at).

``flock`` is honoured across nodes on Lustre/GPFS/NFSv4 mounts configured for it
(``flock``/``localflock`` mount options differ: see docs/reliability.md).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

LOCK_NAME = ".hapo.lock"
HELD_ENV = "HAPO_RUN_LOCK_HELD"
_held: dict[str, int] = {}  # resolved dir -> fd, for this process


class RunDirBusy(ValueError):
    pass


def acquire(out_dir: str | Path) -> Path:
    """Take ``out_dir``'s lock for the rest of this process (idempotent)."""
    d = Path(out_dir).resolve()
    key = str(d)
    if key in _held or os.environ.get(HELD_ENV) == key:
        return d / LOCK_NAME
    d.mkdir(parents=True, exist_ok=True)
    path = d / LOCK_NAME
    fd = _open_lock_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise
        holder = _read_holder(fd)
        os.close(fd)
        raise RunDirBusy(f"output directory {d} is in use by {holder}; wait for it to finish, stop it, or "
                         f"choose another --output-dir") from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "cmd": " ".join(sys.argv[:4])}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    os.fsync(fd)
    _held[key] = fd
    return path


def _open_lock_file(path: Path) -> int:
    """Open (or create) the lock file itself, never what a planted symlink points at: with
    ``O_NOFOLLOW`` a link fails to open (ELOOP), and anything but a regular file (a FIFO, a
    device, a directory) is refused before it is written to. ``O_NONBLOCK`` keeps a planted
    FIFO from blocking the open."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunDirBusy(f"{path} is a symbolic link; refusing to follow it (it could point at any file). "
                             f"Remove it and run again") from None
        if e.errno == errno.EISDIR:
            raise RunDirBusy(f"{path} is a directory, not a lock file; remove it and run again") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunDirBusy(f"{path} is not a regular file; refusing to use it as the run lock. Remove it and run again")
    return fd


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"PID {info['pid']} on {info['host']} since {info['since']} ({info.get('cmd', '?')})"
    except (ValueError, KeyError, OSError):
        return "another process (its lock file names no holder yet)"


def release(out_dir: str | Path) -> None:
    fd = _held.pop(str(Path(out_dir).resolve()), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor drops the flock


def child_env(out_dir: str | Path, env: dict | None = None) -> dict:
    """Environment for a child that works in ``out_dir`` under this process's lock."""
    return {**(env if env is not None else os.environ), HELD_ENV: str(Path(out_dir).resolve())}
