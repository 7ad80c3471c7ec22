"""Multi-run experiments on the embedded trainer (variants x seeds from shared warm
starts) and their report: ``hapo experiment`` / ``hapo report EXPERIMENT_DIR``.

The names below are imported on first use (PEP 562), so that a light submodule -- the
registration's ``code_identity``, which ``scripts/run_registered.py`` runs in a fresh
interpreter -- does not pay for the runner's and the report's imports (torch and the trainer):
about 1.5 s a process."""

from __future__ import annotations

import importlib

_LAZY = {"Experiment": ".spec", "load_experiment": ".spec", "run_experiment": ".runner",
         "build_experiment_report": ".report", "is_experiment_dir": ".report"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
