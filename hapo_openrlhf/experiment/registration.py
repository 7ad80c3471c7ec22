"""Pre-registration, enforced: what an experiment states before its runs is recorded when
the first run starts, and a later invocation cannot quietly change it.

``experiment.json`` gets a ``registration`` block the first time the runner starts on an
output directory: the time, the comparisons, the seeds, and a fingerprint (sha256) of each
variant's settings and of the warm start's (the resolved run config less the per-seed seed,
names and paths). Later invocations:

* a variant or warm start whose settings differ from the fingerprint is refused by name,
  before anything runs (the finished-run check would catch only the runs already finished);
* a comparison that is not in the registration is kept, but listed under
  ``comparisons_added`` with the time it first appeared; the report shows it apart from the
  pre-registered ones, and a registered comparison later dropped from the file is still
  reported;
* seeds and variants first run later are recorded with their time (``seeds_added``,
  ``variants_added``), and the report says so.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from ..jsonfile import read_json_object

PER_SEED = ("seed", "run_name", "output_dir")


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def fingerprint(cfg: dict[str, Any]) -> str:
    """sha256 of a resolved run config without what differs per seed (seed, names, paths)."""
    c = {k: v for k, v in cfg.items() if k not in PER_SEED}
    c["model"] = {k: v for k, v in c.get("model", {}).items() if k != "path"}
    return hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest()


def check_jobs(m: dict[str, Any], path: Path, advice: str = "") -> None:
    """Every ``jobs`` entry of a manifest is an object with a numeric ``wall_s`` (a rerun and
    the report both read them); a damaged one is named."""
    for name, entry in m.get("jobs", {}).items():
        if not isinstance(entry, dict) or not isinstance(entry.get("wall_s", 0.0), (int, float)):
            raise ValueError(f"{path}: jobs[{name!r}] must be an object with a numeric wall_s, got {entry!r:.80}"
                             + (f"; {advice}" if advice else ""))


def read_manifest_for_update(path: Path) -> dict[str, Any]:
    """The previous ``experiment.json`` (empty when there is none), with every field the
    runner reuses checked: a damaged one is named, never a crash halfway through."""
    if not path.exists() and not path.is_symlink():
        return {}
    m = read_json_object(path, "the experiment's manifest")
    aside = "move the file aside to start the manifest afresh (finished runs are found again from their directories)"
    if not isinstance(m.get("suites_run", []), list) or not isinstance(m.get("jobs", {}), dict):
        raise ValueError(f"{path}: 'suites_run' must be a list and 'jobs' an object; {aside}")
    check_jobs(m, path, aside)
    reg = m.get("registration")
    if reg is not None and not (isinstance(reg, dict) and isinstance(reg.get("at"), str)
                                and isinstance(reg.get("settings"), dict) and isinstance(reg.get("comparisons"), list)
                                and isinstance(reg.get("seeds"), list)):
        raise ValueError(f"{path}: 'registration' is damaged (it must hold at, settings, comparisons and seeds); "
                         f"the pre-registration record cannot be trusted: restore it, or use another --output-dir")
    return m


def register(previous: dict[str, Any], exp, variants: list[str], path: Path) -> dict[str, Any]:
    """The manifest fields that record the pre-registration (new, or checked and extended)."""
    t = now()
    settings = {v: fingerprint(exp.runs[(v, exp.seeds[0])].config) for v in variants}
    warm = fingerprint(exp.warm_jobs()[0].config)
    comps = [dict(c) for c in exp.comparisons]
    reg = previous.get("registration")
    if reg is None:
        reg = {"at": t, "comparisons": comps, "seeds": list(exp.seeds), "settings": settings, "warm_start": warm}
        if previous.get("jobs"):  # a manifest from before registration records: runs exist already
            reg["recorded_after_runs"] = True
        return {"registration": reg, "comparisons_added": [], "seeds_added": {}, "variants_added": {}}
    changed = [v for v, fp in settings.items() if reg["settings"].get(v, fp) != fp]
    if reg.get("warm_start", warm) != warm:
        changed.insert(0, "the warm start")
    if changed:
        raise ValueError(f"{path}: {', '.join(changed)} now resolve to a different configuration than the one "
                         f"registered when this experiment's runs started ({reg['at']}); pre-registered settings "
                         f"cannot change. Use another --output-dir for the new settings")
    added = [dict(c) for c in previous.get("comparisons_added", []) if isinstance(c, dict)]
    for c in comps:
        if c not in reg["comparisons"] and not any(a.get("a") == c["a"] and a.get("b") == c["b"] for a in added):
            added.append({**c, "at": t})
    seeds_added = dict(previous.get("seeds_added") or {})
    for s in exp.seeds:
        if s not in reg["seeds"] and str(s) not in seeds_added:
            seeds_added[str(s)] = t
    variants_added = dict(previous.get("variants_added") or {})
    for v, fp in settings.items():
        if v not in reg["settings"]:
            reg["settings"][v] = fp
            variants_added[v] = t
    return {"registration": reg, "comparisons_added": added, "seeds_added": seeds_added,
            "variants_added": variants_added}
