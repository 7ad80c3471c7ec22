"""An experiment's results in one compact file to keep under version control (issue 60).

The run directories are large and git-ignored; ``results.json`` is what a registered experiment
leaves behind: the manifest's record (seeds, suites, comparisons, the registration with its code
identity and family-wise level, the warm starts the seeds nest in, later additions and code
changes) and, per finished run, what the report's tables read (:class:`~.stats.RunStats`: the
held-out Avg@k / Pass@k at each evaluation, the behaviour entropy and the four quadrants' token
share and entropy per step, the wall time, and the token-credit counts of its dumped token samples,
exactly: ``credit.credit_counts``) with the run's config fingerprint and the code it ran with
(``registration.run_code``: package sources sha256, git commit and whether the tree was dirty,
torch and transformers; recorded by the runner since 2026-12-07). ``hapo report results.json``
rebuilds every table and figure of the experiment report from it alone, in a fresh clone, the
token-credit table included. A file written before the credit counts were kept (League 2's
``results/league2.json``, whose run directories are gone) loads, and its report says it has no
token-credit table.

The runner writes ``OUTPUT/results.json`` after every job; ``hapo report EXPERIMENT_DIR
--results FILE`` writes one where you want it (e.g. ``results/league2.json``, committed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..algos.quadrants import QUADRANTS
from ..rundir.jsonfile import read_json_object
from .credit import check_counts
from .stats import QUADRANT_STATS, RunStats

FORMAT = "hapo-experiment-results/1"
# the manifest's fields the report reads (the run directories' paths are left out: they are not kept)
MANIFEST_KEYS = ("experiment", "seeds", "suites", "suites_run", "workers", "threads_per_worker", "comparisons",
                 "warm_start_seed", "warm_start_of_seed", "familywise_alpha", "registration", "comparisons_added",
                 "seeds_added", "variants_added", "code_changes", "failed", "wall_s_this_invocation")


def _r(x: Any) -> Any:
    """Six significant digits for the per-step curves (the file stays small; the report prints three);
    the held-out Avg@k / Pass@k, which the verdicts read, are kept exactly."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, list):
        return [_r(v) for v in x]
    return x


def export(manifest: dict, runs: list[RunStats], fingerprints: dict[str, str] | None = None) -> dict[str, Any]:
    """The results document of an experiment directory's manifest and finished runs."""
    jobs = manifest.get("jobs", {})
    out_runs = []
    for r in runs:
        name = f"{r.variant}/seed_{r.seed}"
        out_runs.append({
            "variant": r.variant, "seed": r.seed, "k": r.k, "steps": r.steps, "wall_s": _r(r.wall_s),
            "eval_steps": r.eval_steps, "avg": r.avg, "pass": r.pass_, "train_steps": r.train_steps,
            "entropy": _r(r.entropy),
            "quadrant": {q: {s: _r(r.quadrant.get(q, {}).get(s, [])) for s in QUADRANT_STATS} for q in QUADRANTS},
            "status": (jobs.get(name) or {}).get("status", "done"),
            **({"credit": r.credit} if r.credit is not None else {}),  # exact: counts and sums, 12 numbers
            **({"code": r.code} if r.code is not None else {}),  # the code the run ran with
            **({"config_sha256": fingerprints[name]} if fingerprints and name in fingerprints else {}),
        })
    return {"format": FORMAT, "manifest": {k: manifest[k] for k in MANIFEST_KEYS if k in manifest},
            "runs": out_runs}


def write(path: str | Path, doc: dict[str, Any]) -> Path:
    """Atomically (a temp file renamed into place): a half-written results file never replaces a good one."""
    import os

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a directory: name the results file to write (e.g. results/NAME.json)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=None, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
    return path


def is_results_file(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_file() or p.suffix != ".json":
        return False
    try:
        return read_json_object(p, "a results file").get("format") == FORMAT
    except ValueError:
        return False


def load(path: str | Path) -> tuple[dict, list[RunStats]]:
    """(manifest, runs) from a results file, every field the report reads checked by name."""
    path = Path(path)
    doc = read_json_object(path, "the experiment's results file")
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a results file of this format (format {doc.get('format')!r}, want {FORMAT!r})")
    m, rows = doc.get("manifest"), doc.get("runs")
    if not isinstance(m, dict) or not isinstance(rows, list):
        raise ValueError(f"{path}: 'manifest' must be an object and 'runs' a list")
    for key in ("seeds", "suites"):
        if key not in m:
            raise ValueError(f"{path}: manifest lacks {key!r}")
    runs = []
    for i, r in enumerate(rows):
        try:
            quad = {q: {s: [None if x is None else _num(x) for x in r["quadrant"][q][s]] for s in QUADRANT_STATS}
                    for q in QUADRANTS}  # a step without the quadrant stays None, as the metrics file has it
            runs.append(RunStats(variant=str(r["variant"]), seed=int(r["seed"]), k=int(r["k"]), steps=int(r["steps"]),
                                 eval_steps=[int(x) for x in r["eval_steps"]], avg=[_num(x) for x in r["avg"]],
                                 pass_=[_num(x) for x in r["pass"]], train_steps=[int(x) for x in r["train_steps"]],
                                 entropy=[_num(x) for x in r["entropy"]], quadrant=quad,
                                 wall_s=None if r.get("wall_s") is None else float(r["wall_s"]),
                                 credit=check_counts(r["credit"], f"{path}: runs[{i}]") if "credit" in r else None,
                                 code=_code(r["code"], f"{path}: runs[{i}]") if "code" in r else None))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: runs[{i}] is damaged ({type(e).__name__}: {e})") from None
        if not runs[-1].avg or len(runs[-1].avg) != len(runs[-1].eval_steps):
            raise ValueError(f"{path}: runs[{i}] ({r.get('variant')}/seed_{r.get('seed')}): avg and eval_steps differ "
                             f"in length or are empty")
    m = dict(m)
    m.setdefault("suites_run", sorted(m["suites"]))
    m.setdefault("jobs", {})
    m["runs"] = {f"{r.variant}/seed_{r.seed}": "" for r in runs}
    return m, runs


def _code(x: Any, where: str) -> dict:
    """A run's recorded code identity: an object of strings and booleans (registration.run_code)."""
    if not isinstance(x, dict) or not all(isinstance(k, str) and isinstance(v, (str, bool)) for k, v in x.items()):
        raise ValueError(f"{where}: code must map names to strings or booleans, got {x!r:.80}")
    return dict(x)


def _num(x: Any) -> float:
    if x is None:
        return float("nan")
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"expected a number, got {x!r:.40}")
    return float(x)
