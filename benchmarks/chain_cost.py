"""The chain task's cost: one warm start, then one 30-step RL run per variant with its final
held-out evaluation, at the decisive experiment's settings (configs/experiments/decisive.yaml:
the 0.8M-parameter chain model, 80-token responses, Avg@8 on 512 problems), each job in one
worker process with one thread -- as the experiment runs them -- timed by the experiment's own
``experiment.json`` (each job's wall time).

Pass ``--repo`` to time another checkout (for example today's main in a ``git worktree``) with
the same command, so two versions are compared in one session on one machine:

    git worktree add /tmp/base <commit>
    python benchmarks/chain_cost.py --repo /tmp/base --out /tmp/cost_base
    python benchmarks/chain_cost.py --out /tmp/cost_head
    python benchmarks/chain_cost.py --compare /tmp/cost_base /tmp/cost_head

Prints one JSON object per run: the wall time of the warm start and of each RL run (its 30
steps and its final evaluation), and with ``--compare`` the ratios (head / base).

``--rerun`` times the RL runs again in an ``--out`` that already holds them: their
directories are moved aside (``runs.1``, ``runs.2``, ...) and the finished warm start is
reused (the experiment skips it; it took about 8 minutes here). Two checkouts can then be
timed side by side, one per core, under the same load:

    python benchmarks/chain_cost.py --repo /tmp/base --out /tmp/cost_base --rerun &
    python benchmarks/chain_cost.py --out /tmp/cost_head --rerun; wait
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _experiment_file(repo: Path, out: Path, variants: list[str]) -> Path:
    import yaml

    spec = yaml.safe_load((repo / "configs" / "experiments" / "decisive.yaml").read_text())
    cfg_dir = repo / "configs" / "experiments"
    for v in spec["variants"].values():  # absolute paths: the file is written elsewhere
        if "config" in v:
            v["config"] = str((cfg_dir / v["config"]).resolve())
    spec["run_config"] = str((cfg_dir / spec["run_config"]).resolve())
    spec.update(output_dir=str(out), workers=1, threads_per_worker=1, seeds=[101], warm_start_seed=100)  # the warm start is trained with a seed no RL run uses (the experiment rule)
    spec["suites"] = {"cost": variants}
    spec["comparisons"] = []
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run(repo: Path, out: Path, variants: list[str], rerun: bool = False, overrides: tuple[str, ...] = ()) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if rerun and (out / "runs").is_dir():
        n = 1
        while (out / f"runs.{n}").exists():
            n += 1
        (out / "runs").rename(out / f"runs.{n}")
    exp = _experiment_file(repo, out, variants)
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    sets = [a for kv in overrides for a in ("--set", kv)]
    subprocess.run([sys.executable, "-m", "hapo_openrlhf.cli", "experiment", "cost", "--config", str(exp), *sets],
                   cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL)
    total = time.perf_counter() - t0
    manifest = json.loads((out / "experiment.json").read_text())
    jobs = manifest.get("jobs") or manifest.get("results") or {}
    rows = jobs.values() if isinstance(jobs, dict) else jobs
    walls = {r["name"]: round(r["wall_s"], 1) for r in rows}
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no")
                                                    else "")
    return {"repo": str(repo), "commit": commit, "total_s": round(total, 1), "jobs_s": walls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, default=REPO)
    ap.add_argument("--out", type=Path, default=Path("runs/chain_cost"))
    ap.add_argument("--variants", default="grpo,hapo")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BASE", "HEAD"))
    ap.add_argument("--rerun", action="store_true", help="move the RL runs in --out aside and time them again")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a run-config key in every run (a reduced smoke run; not for the figures)")
    a = ap.parse_args()
    if a.compare:
        base, head = (json.loads((d / "cost.json").read_text()) for d in a.compare)
        ratios = {k: round(head["jobs_s"][k] / base["jobs_s"][k], 3) for k in base["jobs_s"] if k in head["jobs_s"]}
        print(json.dumps({"base": base["commit"], "head": head["commit"], "ratio_head_over_base": ratios}))
        return
    res = run(a.repo.resolve(), a.out.resolve(), a.variants.split(","), a.rerun, tuple(a.set))
    (a.out / "cost.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
