"""Reading the small files the project owns or is handed (a model's ``config.json`` and
``hapo.json``, eval ``settings.json``, config and experiment YAML, ...) with a named error for
a damaged one: the file, what is wrong, and never a bare ``JSONDecodeError``.

Every such read is bounded (:func:`read_small_text`): the path must be a regular file (a
FIFO would block forever, ``/dev/zero`` would fill memory) of at most ``max_bytes``, and its
text must be UTF-8; otherwise a ``ValueError`` names the file and what it is."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

# config files, experiment files, manifests, eval.json: far below this
MAX_SMALL_FILE = 16 * 2**20


def read_small_text(path: str | Path, what: str = "", max_bytes: int = MAX_SMALL_FILE) -> str:
    """The UTF-8 text of the regular file ``path`` (links followed), read at most
    ``max_bytes`` (+1, to detect a larger one). Opened with ``O_NONBLOCK`` so a FIFO planted
    at the path cannot block the open; anything but a regular file is refused by name."""
    data = read_small_bytes(path, what, max_bytes)
    label = f"{Path(path)}" + (f" ({what})" if what else "")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{label} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def read_small_bytes(path: str | Path, what: str = "", max_bytes: int = MAX_SMALL_FILE) -> bytes:
    """The bytes of the regular file ``path``, bounded as :func:`read_small_text`."""
    p = Path(path)
    label = f"{p}" + (f" ({what})" if what else "")
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise ValueError(f"{label} not found") from None
        raise ValueError(f"{label} cannot be read: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a special file")
            raise ValueError(f"{label} is {kind}, not a regular file; refusing to read it")
        if st.st_size > max_bytes:
            raise ValueError(f"{label} is {st.st_size} bytes, more than the {max_bytes} a file of this kind may hold")
        chunks, n = [], 0
        while n <= max_bytes:
            b = os.read(fd, min(1 << 20, max_bytes + 1 - n))
            if not b:
                break
            chunks.append(b)
            n += len(b)
        if n > max_bytes:
            raise ValueError(f"{label} grew past the {max_bytes} bytes a file of this kind may hold while it was read")
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_json_object(path: str | Path, what: str = "") -> dict[str, Any]:
    """The JSON object in ``path``; ``ValueError`` naming the file when it is unreadable, not
    a regular file, too large, not JSON, or not an object (``what`` says what the file is for,
    for the message)."""
    p = Path(path)
    label = f"{p}" + (f" ({what})" if what else "")
    text = read_small_text(p, what)
    try:
        obj = json.loads(text)
    except ValueError as e:  # JSONDecodeError
        raise ValueError(f"{label} is unreadable or not JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{label} holds a JSON {type(obj).__name__}, not an object")
    return obj


def check_safetensors(path: str | Path) -> None:
    """A ``.safetensors`` file whose header reads (a truncated or partly copied one does not):
    ``ValueError`` naming it. Reads the header only, not the tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError and OSError
        raise ValueError(f"{path} is incomplete or corrupt (a truncated download or an interrupted save?): "
                         f"{str(e)[:200]}") from None
