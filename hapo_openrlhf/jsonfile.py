"""Reading the small JSON files the project owns or is handed (a model's ``config.json`` and
``hapo.json``, eval ``settings.json``, ...) with a named error for a damaged one: the file,
what is wrong, and never a bare ``JSONDecodeError``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json_object(path: str | Path, what: str = "") -> dict[str, Any]:
    """The JSON object in ``path``; ``ValueError`` naming the file when it is unreadable, not
    JSON, or not an object (``what`` says what the file is for, for the message)."""
    p = Path(path)
    label = f"{p}" + (f" ({what})" if what else "")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
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
