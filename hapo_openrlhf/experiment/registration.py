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

Code (issue 60): a later invocation whose package sources, torch or transformers differ from the
registered ``code`` is refused by name, unless ``--code-change REASON`` is given: the reason, the
differences and the time are appended to ``code_changes``, and the report prints them. The
family-wise level of Holm's verdicts (``familywise_alpha``) is frozen with the registration.

The machine's CPU arithmetic is part of what a run's numbers depend on, and is recorded and checked
the same way (``code`` holds it beside the code: :func:`arithmetic_identity`): the same code and seed
gave another run on another machine (League 2's registered code, 5a482dd, on an AVX2 machine: GRPO
seed 701 ends at held-out 0.7866 where League 2's run on the machine it ran on ended at 0.7581, and
its warm start at 0.5686 against 0.5691; docs/reproduction.md, "League 2"). A registration or run
that predates the record has no arithmetic to compare, and is not flagged.

The registration is written before the first job runs (not when it ends: a runner stopped during
the warm start leaves it), holds the code that runs it (``code``: the package's version, a
sha256 of its sources, and the git commit where there is one), and is marked
``recorded_after_runs`` when finished runs predate it -- whatever the manifest's history, so a
manifest moved aside (the runner's own advice for a damaged one) cannot launder a comparison
added after the results into a pre-registered one: the finished runs' directories are older.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from ..rundir.jsonfile import read_json_object

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


def code_identity() -> dict[str, Any]:
    """What code runs the experiment: hapo-openrlhf's version, a sha256 over its Python sources
    (path and content, sorted), the versions of torch and transformers, and the git commit (with
    ``dirty``: the package's tree differs from it) when the package is a checkout."""
    import subprocess
    from importlib import metadata

    pkg = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    out: dict[str, Any] = {"sources_sha256": h.hexdigest()}
    for key, dist in (("version", "hapo-openrlhf"), ("torch", "torch"), ("transformers", "transformers")):
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        head = subprocess.run(["git", "-C", str(pkg), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(pkg), "status", "--porcelain", "--", "."], capture_output=True,
                                   text=True, timeout=10)
            out["git_commit"] = head.stdout.strip()
            out["git_dirty"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def arithmetic_identity() -> dict[str, str]:
    """The machine's CPU arithmetic, which a run's numbers depend on beside the code: ATen's CPU
    capability (the vector kernels torch dispatches to: ``DEFAULT``, ``AVX2``, ``AVX512``, ...; the
    matrix products' kernels follow the same instruction set) and the CPU's model name (the math
    libraries also choose kernels by vendor and model). Imports torch, unlike :func:`code_identity`."""
    import platform

    import torch

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
            "cpu_model": model or platform.processor() or platform.machine() or "unknown"}


def run_identity() -> dict[str, Any]:
    """What an invocation's runs are computed with: :func:`code_identity` and :func:`arithmetic_identity`."""
    return {**code_identity(), **arithmetic_identity()}


# what makes two invocations "the same code": the package's sources and the libraries its numbers depend on
SOURCE_KEYS = ("sources_sha256", "torch", "transformers")
# ... and the machine's CPU arithmetic (arithmetic_identity)
ARITHMETIC_KEYS = ("cpu_capability", "cpu_model")
CODE_KEYS = SOURCE_KEYS + ARITHMETIC_KEYS
# what each run records of the code it ran with (the runner, experiment.json's jobs; the results file)
RUN_CODE_KEYS = ("sources_sha256", "git_commit", "git_dirty", "torch", "transformers") + ARITHMETIC_KEYS


def run_code(code: dict[str, Any]) -> dict[str, Any]:
    """The part of :func:`run_identity` a finished run keeps."""
    return {k: code[k] for k in RUN_CODE_KEYS if k in code}


def code_difference(registered: dict[str, Any], current: dict[str, Any],
                    keys: tuple[str, ...] = CODE_KEYS) -> list[str]:
    """``key: registered -> current`` for each of ``keys`` both record and that differ."""
    return [f"{k}: {registered[k]} -> {current[k]}" for k in keys
            if k in registered and k in current and registered[k] != current[k]]


def _stamp(t: str) -> float:
    import calendar

    return float(calendar.timegm(time.strptime(t, "%Y-%m-%dT%H:%M:%SZ")))


def register(previous: dict[str, Any], exp, variants: list[str], path: Path,
             finished: dict[str, float] | None = None, code_change: str | None = None,
             code: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest fields that record the pre-registration (new, or checked and extended).
    ``finished``: each finished run's name -> when it finished (its summary's mtime): runs that
    finished before the registration mark it ``recorded_after_runs``. A later invocation from other
    code (:data:`CODE_KEYS`) is refused by name unless ``code_change`` gives the reason, which is
    recorded (``code_changes``) and printed by the report; so is one on other CPU arithmetic. ``code``:
    this invocation's :func:`run_identity` (computed here when not given)."""
    t = now()
    code = code or run_identity()  # the runner passes the one it stamps this invocation's runs with
    finished = finished or {}
    settings = {v: fingerprint(exp.runs[(v, exp.seeds[0])].config) for v in variants}
    warm = fingerprint(exp.warm_jobs()[0].config)
    comps = [dict(c) for c in exp.comparisons]
    reg = previous.get("registration")
    if reg is None:
        reg = {"at": t, "comparisons": comps, "seeds": list(exp.seeds), "settings": settings, "warm_start": warm,
               "code": code, "familywise_alpha": exp.familywise_alpha,
               # the file's seeds, for the later invocations that run the ones --seeds left out
               "planned_seeds": list(exp.file_seeds or exp.seeds)}
        before = sorted(n for n in finished if not n.startswith("warm_start"))
        if previous.get("jobs") or before:  # runs exist already: this registration follows them
            reg["recorded_after_runs"] = True
            if before:
                reg["runs_before_registration"] = before
        return {"registration": reg, "comparisons_added": [], "seeds_added": {}, "variants_added": {},
                "code_changes": []}
    before = sorted(n for n, when in finished.items() if not n.startswith("warm_start") and when < _stamp(reg["at"]))
    if before and not reg.get("recorded_after_runs"):  # a registration written after its results
        reg["recorded_after_runs"] = True
        reg["runs_before_registration"] = before
    changed = [v for v, fp in settings.items() if reg["settings"].get(v, fp) != fp]
    if reg.get("warm_start", warm) != warm:
        changed.insert(0, "the warm start")
    if changed:
        raise ValueError(f"{path}: {', '.join(changed)} now resolve to a different configuration than the one "
                         f"registered when this experiment's runs started ({reg['at']}); pre-registered settings "
                         f"cannot change. Use another --output-dir for the new settings")
    if reg.get("familywise_alpha", exp.familywise_alpha) != exp.familywise_alpha:
        raise ValueError(f"{path}: familywise_alpha is now {exp.familywise_alpha}, registered as "
                         f"{reg['familywise_alpha']} ({reg['at']}); the level of the pre-registered verdicts cannot "
                         f"change. Use another --output-dir")
    changes = [dict(c) for c in previous.get("code_changes") or [] if isinstance(c, dict)]
    registered = reg.get("code") or {}
    diff = code_difference(registered, code)
    if diff and not code_change:
        sources = code_difference(registered, code, SOURCE_KEYS)
        arith = code_difference(registered, code, ARITHMETIC_KEYS)
        what = ([f"with other code than this checkout's ({'; '.join(sources)})"] if sources else []) + (
            [f"on other CPU arithmetic than this machine's ({'; '.join(arith)}: the same code and seed compute "
             f"another run there)"] if arith else [])
        where = ([f"from the registered code (git commit {registered.get('git_commit', 'unknown')})"] if sources else []
                 ) + (["on a machine with the registered CPU"] if arith else [])
        raise ValueError(f"{path}: this experiment was registered ({reg['at']}) {' and '.join(what)}; such runs would "
                         f"not be the registered experiment's. Run it {' and '.join(where)}, or pass --code-change "
                         f"'REASON' to go on, recorded and printed in the report")
    if diff:
        changes.append({"at": t, "reason": str(code_change), "differences": diff,
                        "git_commit": code.get("git_commit"), "git_dirty": code.get("git_dirty")})
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
            "variants_added": variants_added, "code_changes": changes}
