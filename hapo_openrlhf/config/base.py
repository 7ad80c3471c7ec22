"""What every config section shares: frozen mappings, the named check, plain data for checkpoints."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping


class FrozenDict(dict):
    """A read-only, picklable dict for free-form parameter maps."""

    def _ro(self, *a, **k):
        raise TypeError("config parameters are read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _ro  # type: ignore

    def __reduce__(self):
        return (FrozenDict, (dict(self),))


def freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return FrozenDict({k: freeze(x) for k, x in v.items()})
    if isinstance(v, list):
        return tuple(freeze(x) for x in v)
    return v


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def asdict_deep(obj: Any) -> Any:
    """``dataclasses.asdict`` with each field under its config key (field metadata "key")."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.metadata.get("key", f.name): asdict_deep(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: asdict_deep(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [asdict_deep(x) for x in obj]
    return obj


def to_plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: to_plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [to_plain(x) for x in v]
    return v


@functools.lru_cache(maxsize=None)
def choices(cls, name: str) -> tuple[str, ...]:
    """The values a ``Literal[...]``-typed field of config section ``cls`` may take (its type is the
    one list of them; ``__post_init__`` refuses any other by name)."""
    import typing

    return typing.get_args(typing.get_type_hints(cls)[name])
