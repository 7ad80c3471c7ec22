"""Loading: YAML with ``base:`` includes, ``--set`` overrides, coercion to the typed sections (named
errors), the dict that carries a config across Ray (``transported``), and the dump."""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from .run import RunConfig


# ------------------------------------------------------------------ loading
def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{key}: bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}: expected a mapping, got {value!r}")
        return from_dict(tp, value, key)
    if origin in (Mapping, dict, collections.abc.Mapping) or tp is Mapping:
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}: expected a mapping (e.g. {{alpha: 0.2}}), got {value!r}")
        return value
    if tp is Any:
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {value!r}")
        return tuple(_coerce(v, args[0], key) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads "1e-4" as a string; accept it explicitly
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{key}: expected a number, got {value!r}") from None
        if not math.isfinite(value):  # no config number means anything at inf or NaN
            raise ValueError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if origin is typing.Literal:  # a choice: a string here; the section names the choices (__post_init__)
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {value!r}")
        return value
    return value


# the modes of each "off | ..." switch, named when a config says `on`
ON_MODES = {"routing_replay": "r3", "level": "token or seq"}


def from_dict(cls, data: Mapping[str, Any], prefix: str = ""):
    """Build dataclass ``cls`` from ``data``; unknown keys raise naming the dotted key."""
    hints = typing.get_type_hints(cls)
    # a field whose config key is a Python keyword carries it as metadata (openrlhf.async -> async_)
    field_of = {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(cls)}
    names = list(field_of)
    # an "off | ..." switch: YAML 1.1 reads a bare `off` as false (`routing_replay: off`)
    offs = {f.name for f in dataclasses.fields(cls) if f.default == "off"}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in field_of:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else ""
            raise ValueError(f"unknown config key {key!r}{hint}")
        if v is False and field_of[k] in offs:
            v = "off"
        elif v is True and field_of[k] in offs:  # `on` / `true` / `yes`: which "on" is meant is the user's to say
            modes = ON_MODES.get(field_of[k], "a named mode")
            raise ValueError(f"{key}: YAML reads a bare on / true / yes as true, and this switch is off or "
                             f"{modes}: write {modes}, or off")
        kwargs[field_of[k]] = _coerce(v, hints[field_of[k]], key)
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"invalid config{' section ' + repr(prefix) if prefix else ''}: {e}") from None


# the typed config per transported dict: each process rebuilds it once (``transported``)
_TRANSPORTED: dict[int, tuple[Mapping[str, Any], RunConfig]] = {}


def transported(data: Mapping[str, Any]) -> RunConfig:
    """The typed :class:`RunConfig` from the plain dict that carries it across the Ray boundary
    (``RunConfig.to_dict()``, OpenRLHF's ``args.hapo``): validated again, and rebuilt once per process
    and dict. Every actor and the controller read typed fields from it; the dict is only transport."""
    hit = _TRANSPORTED.get(id(data))
    if hit is None or hit[0] is not data:
        hit = (data, from_dict(RunConfig, data))
        _TRANSPORTED[id(data)] = hit
    return hit[1]


def load_yaml(text: str, what: str) -> Any:
    """``yaml.safe_load`` without aliases: an alias (``*name``) refers back to an anchor, and
    nested ones expand exponentially (a few hundred bytes of "billion laughs" take minutes of
    CPU and gigabytes in ``safe_load``). No hapo config needs them, so any alias is refused
    before the document is built, naming ``what`` (the file or the ``--set`` key)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML has it: ~10x faster
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.AliasEvent):
            raise ValueError(f"{what}: YAML aliases (*{event.anchor}) are not allowed in hapo configs; write the "
                             f"value out")
    return yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader (SafeLoader or its C twin)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``["trainer.steps=5", "algorithm.estimator=grpo"]`` applied to a raw dict (YAML values)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value")
        path, val = item.split("=", 1)
        node = raw
        parts = path.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p!r} is not a section")
        try:
            node[parts[-1]] = load_yaml(val, f"--set {path.strip()}")
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ValueError(f"--set {path.strip()}: {val!r} is not a YAML value ({problem}); quote it, "
                             f"e.g. --set '{path.strip()}=\"...\"'") from None
    return raw


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: sections merge key by key; any other value replaces the base's."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict) and k not in _OPAQUE:
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


# free-form parameter maps are replaced whole, never merged (params of another algorithm
# would otherwise leak in and be rejected)
_OPAQUE = ("estimator_params", "loss_params")


# a ``base:`` chain longer than this is a mistake (a generated loop of files), not a config
MAX_BASE_DEPTH = 32


def read_raw(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The YAML mapping at ``path`` with its ``base:`` chain (relative paths) merged in. Each
    file is read bounded (a regular UTF-8 file of at most 16 MiB: ``jsonfile.read_small_text``),
    and the chain may be at most ``MAX_BASE_DEPTH`` files deep."""
    from ..rundir.jsonfile import read_small_text

    chain: list[dict[str, Any]] = []
    p, shown = Path(path), str(path)
    seen = list(_seen)
    while True:
        p = p.resolve()
        if p in seen:
            raise ValueError(f"config base cycle: {' -> '.join(str(s) for s in (*seen, p))}")
        if len(seen) >= MAX_BASE_DEPTH:
            raise ValueError(f"config file {shown!r}: its base: chain is more than {MAX_BASE_DEPTH} files deep "
                             f"(from {str(seen[0])!r}); flatten it")
        if not p.exists():
            raise ValueError(f"config file {shown!r} not found")
        text = read_small_text(p, f"config file {shown!r}" if shown != str(p) else "config file")
        try:
            raw = load_yaml(text, f"config file {shown!r}") or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {shown!r} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"config file {shown!r} must hold a mapping at the top level")
        seen.append(p)
        base = raw.pop("base", None)
        chain.append(raw)
        if base is None:
            break
        if not isinstance(base, str) or not base.strip():
            raise ValueError(f"config file {shown!r}: base must be a file name (a string), got {base!r}")
        p, shown = p.parent / base, str(p.parent / base)
    out: dict[str, Any] = {}
    for raw in reversed(chain):
        out = _merge(out, raw)
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load a run config: ``base:`` chain, then ``--set`` overrides, then validation."""
    raw = read_raw(path)
    if not raw:
        raise ValueError(f"config file {str(path)!r} is empty: a run config names at least its run "
                         f"(start from configs/cpu_tiny.yaml, or use `base: cpu_tiny.yaml`)")
    return from_dict(RunConfig, apply_overrides(raw, list(overrides or [])))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
