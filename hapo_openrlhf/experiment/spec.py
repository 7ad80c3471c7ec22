"""Experiment files: many runs (variants x seeds) from shared warm starts.

An experiment YAML names a base run config, the seeds, the variants (each a run
config and/or an override merged on top) and the suites (named lists of
variants). ``load_experiment`` resolves it into one warm-start config per seed (or
one for every seed, ``warm_start_seed``) and one run config per (variant, seed), all
validated up front, so a typo fails before any training starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..config import RunConfig, _merge, apply_overrides, from_dict, read_raw

_KEYS = {"run_config", "output_dir", "seeds", "workers", "threads_per_worker", "common", "variants", "suites",
         "comparisons", "warm_start_seed"}
_VARIANT_KEYS = {"config", "override"}
# a variant may change the algorithm, the optimiser, the rollout and the schedule, but
# not what the shared warm start was built from
SHARED_SECTIONS = ("data", "warmup")
SHARED_MODEL_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_position_embeddings", "tie_word_embeddings")


@dataclass(frozen=True)
class Job:
    """One training process: a warm start (``variant`` None) or an RL run."""

    variant: str | None
    seed: int
    out: Path
    config: dict[str, Any]  # plain dict of a validated RunConfig

    @property
    def name(self) -> str:
        return f"{self.variant or 'warm_start'}/seed_{self.seed}"


@dataclass(frozen=True)
class Experiment:
    path: Path
    output_dir: Path
    seeds: tuple[int, ...]
    workers: int
    threads_per_worker: int
    suites: dict[str, tuple[str, ...]]
    warm: dict[int, Job]  # each seed's warm start (one Job for every seed under ``warm_start_seed``)
    runs: dict[tuple[str, int], Job]
    # pre-registered paired comparisons {a, b} (experiment/verdicts.py), stated before the runs
    comparisons: tuple[dict[str, str], ...] = ()
    warm_start_seed: int | None = None  # one warm start, trained with this seed, shared by every seed's runs

    def warm_jobs(self) -> list[Job]:
        """The distinct warm-start jobs, in seed order."""
        out: dict[str, Job] = {}
        for s in self.seeds:
            out.setdefault(self.warm[s].name, self.warm[s])
        return list(out.values())

    def variants_of(self, suites: list[str]) -> list[str]:
        out: list[str] = []
        for s in suites:
            out += [v for v in self.suites[s] if v not in out]
        return out

    def manifest(self) -> dict[str, Any]:
        return {
            "experiment": str(self.path), "seeds": list(self.seeds), "suites": {k: list(v) for k, v in self.suites.items()},
            "workers": self.workers, "threads_per_worker": self.threads_per_worker,
            "warm_starts": {s: str(j.out) for s, j in self.warm.items()},
            "runs": {f"{v}/seed_{s}": str(j.out) for (v, s), j in self.runs.items()},
            "comparisons": [dict(c) for c in self.comparisons], "warm_start_seed": self.warm_start_seed,
        }


def _err(path: Path, msg: str) -> ValueError:
    return ValueError(f"experiment {str(path)!r}: {msg}")


def load_experiment(path: str | Path, *, seeds: list[int] | None = None, output_dir: str | None = None,
                    workers: int | None = None, overrides: list[str] | None = None,
                    warm_start_seed: int | None = None) -> Experiment:
    """Read and resolve an experiment file. ``overrides`` (``section.key=value``) are merged
    into ``common``, i.e. into every run and warm start; ``warm_start_seed`` replaces the
    file's (one warm start, trained with that seed, for every seed's runs)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"experiment file {str(path)!r} not found")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise _err(path, "must hold a mapping at the top level")
    unknown = set(raw) - _KEYS
    if unknown:
        raise _err(path, f"unknown key(s) {sorted(unknown)}; expected {sorted(_KEYS)}")
    for k in ("run_config", "variants", "suites"):
        if k not in raw:
            raise _err(path, f"missing {k!r}")
    seeds = tuple(seeds if seeds is not None else raw.get("seeds", [1]))
    if not seeds or len(set(seeds)) != len(seeds) or not all(isinstance(s, int) for s in seeds):
        raise _err(path, f"seeds must be distinct integers, got {list(seeds)}")
    workers = int(workers if workers is not None else raw.get("workers", 1))
    threads = int(raw.get("threads_per_worker", 1))
    if workers < 1 or threads < 1:
        raise _err(path, "workers and threads_per_worker must be >= 1")
    out = Path(output_dir or raw.get("output_dir") or f"runs/{path.stem}")
    common = apply_overrides(dict(raw.get("common") or {}), list(overrides or []))

    base_file = path.parent / str(raw["run_config"])
    variants = raw["variants"]
    if not isinstance(variants, dict) or not variants:
        raise _err(path, "variants must be a non-empty mapping name -> {config, override}")
    suites: dict[str, tuple[str, ...]] = {}
    for name, members in (raw["suites"] or {}).items():
        if not isinstance(members, list) or not members:
            raise _err(path, f"suite {name!r} must be a non-empty list of variant names")
        missing = [m for m in members if m not in variants]
        if missing:
            raise _err(path, f"suite {name!r} names unknown variant(s) {missing}")
        suites[str(name)] = tuple(members)
    if "all" in suites:
        raise _err(path, "'all' is reserved (it runs every suite)")
    comparisons = []
    for c in raw.get("comparisons") or []:
        if not (isinstance(c, dict) and set(c) == {"a", "b"} and all(isinstance(c[k], str) for k in "ab")):
            raise _err(path, f"each comparison must be a mapping {{a: variant, b: variant}}, got {c!r}")
        missing = [c[k] for k in "ab" if c[k] not in variants]
        if missing or c["a"] == c["b"]:
            raise _err(path, f"comparison {c!r} names unknown or identical variant(s) {missing or [c['a']]}")
        comparisons.append({"a": c["a"], "b": c["b"]})

    shared = warm_start_seed if warm_start_seed is not None else raw.get("warm_start_seed")
    if shared is not None and (not isinstance(shared, int) or isinstance(shared, bool)):
        raise _err(path, f"warm_start_seed must be an integer (one warm start shared by every seed) or absent "
                         f"(a warm start per seed), got {shared!r}")
    warm = {}
    for s in ([shared] if shared is not None else seeds):
        cfg = _resolve(_merge(read_raw(base_file), common), {
            "seed": s, "run_name": f"warm_start_seed_{s}", "output_dir": str(out / "warm_start" / f"seed_{s}"),
            "trainer": {"steps": 0, "save_every": 0, "eval_every": 0, "threads": threads},
        }, path, "the warm start")
        warm[s] = Job(None, s, out / "warm_start" / f"seed_{s}", cfg)
    if shared is not None:
        warm = {s: warm[shared] for s in seeds}
    runs = {}
    for v, spec in variants.items():
        spec = spec or {}
        if not isinstance(spec, dict) or set(spec) - _VARIANT_KEYS:
            raise _err(path, f"variant {v!r} must be a mapping with keys from {sorted(_VARIANT_KEYS)}")
        vfile = path.parent / str(spec["config"]) if spec.get("config") else base_file
        vraw = _merge(_merge(read_raw(vfile), common), spec.get("override") or {})
        # the variant as written (before the run-only settings below) must match the warm start
        _check_shares_warm_start(_resolve(vraw, {}, path, f"variant {v!r}"), warm[seeds[0]].config, v, path)
        for s in seeds:
            run_out = out / "runs" / v / f"seed_{s}"
            cfg = _resolve(vraw, {
                "seed": s, "run_name": f"{v}_seed_{s}", "output_dir": str(run_out),
                "model": {"path": str((warm[s].out / "final_model").resolve())},
                "warmup": {"steps": 0}, "trainer": {"threads": threads},
            }, path, f"variant {v!r}")
            runs[(v, s)] = Job(v, s, run_out, cfg)
    return Experiment(path, out, seeds, workers, threads, suites, warm, runs, tuple(comparisons), shared)


def _resolve(raw: Mapping[str, Any], forced: Mapping[str, Any], path: Path, what: str) -> dict[str, Any]:
    try:
        return from_dict(RunConfig, _merge(dict(raw), forced)).to_dict()
    except ValueError as e:
        raise _err(path, f"{what}: {e}") from None


def _check_shares_warm_start(cfg: dict, warm: dict, variant: str, path: Path) -> None:
    diff = [s for s in SHARED_SECTIONS if cfg[s] != warm[s]]
    diff += [f"model.{k}" for k in SHARED_MODEL_KEYS if cfg["model"][k] != warm["model"][k]]
    if diff:
        raise _err(path, f"variant {variant!r} changes {diff}, which the shared warm start was built from; "
                         f"put the change in 'common' or in run_config instead")


def config_matches(run_dir: Path, cfg: dict[str, Any]) -> bool:
    """Whether the run config saved in ``run_dir`` is ``cfg`` (a finished run is only reused
    when it was made with the configuration the experiment asks for now)."""
    saved = run_dir / "config.yaml"
    if not saved.exists():
        return False
    return json.dumps(yaml.safe_load(saved.read_text()), sort_keys=True) == json.dumps(
        yaml.safe_load(yaml.safe_dump(cfg, sort_keys=False)), sort_keys=True)
