"""Name -> function registries for advantage estimators and policy losses.

The registry is the only way a trainer reaches an algorithm (no ``if name ==``
chains elsewhere). Parameters are checked against the registered function's
keyword-only signature, so a config typo fails at load time, not mid-run.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable[..., Any]
    validate: Callable[[Mapping[str, Any]], None] | None
    params: tuple[str, ...]  # keyword-only parameters a config may set
    defaults: Mapping[str, Any]
    accepts: frozenset[str]  # every parameter name the function takes
    # what a method declares beside its function, in the same registration (the hooks its registry
    # names; the policy losses' are described in ``algos/losses.py``): state kept across steps, its
    # update, resume and restore check, its own metric keys, and whether it is row-local
    step_state: Callable[..., Any] | None = None
    observe: Callable[..., Any] | None = None
    resume: Callable[..., Any] | None = None
    check_state: Callable[..., Any] | None = None
    metrics: tuple[str, ...] = ()
    row_local: bool = False
    trains_prm: bool = False  # an estimator that reads an implicit PRM's q (advantages.py, ESTIMATORS)

    @property
    def stateful(self) -> bool:
        """The method keeps state across steps (the trainers build it each step and checkpoint it)."""
        return self.step_state is not None or self.observe is not None


class Registry:
    """A named collection of algorithm functions.

    ``fixed`` names the keyword-only arguments a trainer supplies itself
    (tensors, normalisers); everything else keyword-only is a tunable
    parameter a config may set.
    """

    def __init__(self, kind: str, fixed: tuple[str, ...], required: tuple[str, ...] = (),
                 hooks: tuple[str, ...] = ()):
        self.kind = kind
        self.hooks = hooks  # the Entry fields a registration may set beside the function
        self.fixed = fixed
        # trainer-supplied arguments every registered function must take (e.g. every policy
        # loss must apply the rollout/training mismatch weight): checked at registration
        self.required = required
        self._entries: dict[str, Entry] = {}
        self._refused: dict[str, str] = {}  # name -> why it is not implemented (algos/unpublished.py)

    def register(self, name: str, validate: Callable[[Mapping[str, Any]], None] | None = None, **hooks: Any):
        """Register ``name``: the function, its parameters' check, and everything else the method
        declares (``hooks``: this registry's named fields of :class:`Entry`), in one statement."""
        unknown = sorted(set(hooks) - set(self.hooks))
        if unknown:
            raise TypeError(f"{self.kind} {name!r}: unknown registration field(s) {unknown}; "
                            f"a {self.kind} may declare {list(self.hooks)}")
        if "metrics" in hooks:
            hooks["metrics"] = tuple(hooks["metrics"])

        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            sig = inspect.signature(fn)
            params, defaults = [], {}
            for p in sig.parameters.values():
                if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.name in self.fixed:
                    continue
                params.append(p.name)
                if p.default is not inspect.Parameter.empty:
                    defaults[p.name] = p.default
            accepts = frozenset(sig.parameters)
            missing = [r for r in self.required if r not in accepts]
            if missing:
                raise TypeError(f"{self.kind} {name!r} must take the keyword argument(s) {missing} "
                                f"(every {self.kind} applies them; see its module docstring)")
            self._entries[name] = Entry(name, fn, validate, tuple(params), defaults, accepts, **hooks)
            return fn

        return deco

    def refuse(self, name: str, why: str) -> None:
        """Name a method that is deliberately not implemented: a config naming it gets ``why``."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered; it cannot also be refused")
        self._refused[name] = why

    def refused(self) -> dict[str, str]:
        return dict(sorted(self._refused.items()))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def find(self, name: Any) -> Entry | None:
        """``name``'s entry, or None where nothing is registered under it (no error)."""
        return self._entries.get(name) if isinstance(name, str) else None

    def get(self, name: str) -> Entry:
        spelled = _registry_spelling(name)  # as the papers write them: "PRIME", "EP-GRPO"
        if name in self._refused or (spelled in self._refused and spelled not in self._entries):
            key = name if name in self._refused else spelled
            raise ValueError(f"{self.kind} {name!r} is not implemented, by design: {self._refused[key]}")
        if name not in self._entries:
            hint = [spelled] if spelled in self._entries else difflib.get_close_matches(str(name), self._entries, n=1)
            extra = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ValueError(
                f"unknown {self.kind} {name!r}{extra} (registered: {', '.join(self.names())})"
            )
        return self._entries[name]

    def coerce_params(self, name: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` with a string a number-typed parameter can be read as turned into that
        number: YAML 1.1 reads ``1e-3`` (an exponent without a dot) as a string, where the typed
        config keys accept it. Anything else is left for :meth:`check_params` to judge."""
        out = dict(params)
        if name not in self._entries:
            return out
        sig = inspect.signature(self._entries[name].fn)
        for key, value in params.items():
            if key not in sig.parameters or not isinstance(value, str):
                continue
            kinds = {t.strip() for t in str(sig.parameters[key].annotation).split("|")}
            if "float" in kinds:
                try:
                    out[key] = float(value)
                except ValueError:
                    pass
        return out

    def check_params(self, name: str, params: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` for parameters the function does not take or rejects."""
        entry = self.get(name)
        unknown = sorted(set(params) - set(entry.params))
        if unknown:
            raise ValueError(
                f"{self.kind} {name!r} has no parameter(s) {unknown}; "
                f"allowed: {list(entry.params)}"
            )
        _check_types(f"{self.kind} {name!r}", entry.fn, params)
        if entry.validate is not None:
            entry.validate({**entry.defaults, **params})

    def call(self, name: str, /, **kwargs: Any) -> Any:
        """Call ``name``; trainer-supplied (``fixed``) arguments it does not take are dropped."""
        entry = self.get(name)
        self.check_params(name, {k: v for k, v in kwargs.items() if k not in self.fixed})
        return entry.fn(**{k: v for k, v in kwargs.items() if k in entry.accepts})


# float32's range: the losses and estimators compute in the tensors' dtype (float32 at most on the
# GPU paths), where a larger value overflows to inf and a smaller non-zero one underflows to 0
FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38


def _registry_spelling(name: Any) -> str:
    """A method's name as the registry spells it: lower case, ``-`` as ``_`` ("EP-GRPO" -> "ep_grpo")."""
    return str(name).strip().lower().replace("-", "_")


def _check_types(what: str, fn: Callable[..., Any], params: Mapping[str, Any]) -> None:
    """Every numeric parameter (annotated ``float`` / ``int``) is a finite real number (or
    None where the annotation allows it), and every ``eps`` is > 0, before any function
    sees it: a list, a string, a bool, inf or NaN is a named error, not a ``TypeError``
    inside ``float()`` or a run that trains on nonsense (``eps=-1`` would flip the sign of
    every normalised advantage). A float parameter must also fit float32 (the tensors'
    dtype): past 3.4e38 it overflows to inf, a non-zero one below 1.2e-38 underflows to 0
    (a PAEC ``softness`` of 1e-320 made every masked entropy NaN, and the run trained PPO)."""
    import math

    sig = inspect.signature(fn)
    for key, value in params.items():
        ann = str(sig.parameters[key].annotation)
        kinds = {t.strip() for t in ann.split("|")}
        if not kinds & {"float", "int"}:
            continue
        if value is None and "None" in kinds:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            none = " (null, not .inf, means no bound)" if "None" in kinds else ""
            raise ValueError(f"{what}: {key} must be a finite number{' or null' if none else ''}, got {value!r}{none}")
        if "float" not in kinds and not isinstance(value, int):
            raise ValueError(f"{what}: {key} must be an integer, got {value!r}")
        if "float" in kinds and not (value == 0 or FLOAT32_TINY <= abs(value) <= FLOAT32_MAX):
            raise ValueError(f"{what}: {key} = {value!r} is outside what float32 (the computation's dtype) holds: "
                             f"|{key}| must be 0 or between 1.2e-38 and 3.4e38")
        if key == "eps" and not value > 0:
            raise ValueError(f"{what}: eps must be > 0 (it keeps a division by the group's spread finite), "
                             f"got {value!r}")
