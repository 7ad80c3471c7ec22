"""Does the suite still catch a regression? Plant one deliberate one-line breakage in a throw-away
worktree of a commit and run tests there (issue 57: the suite made faster must fail where the old
one did). Prints each failing test and, last, one JSON line.

    python scripts/breakages.py --case sign [--rev HEAD] [--workers 2] [-- PYTEST ARGS...]

The cases (``--case all`` runs each in turn):
* ``sign``: GRPO's group-normalised advantage (the baseline every shaped estimator starts from,
  HAPO's included) with its sign flipped;
* ``optimizer``: the embedded trainer's resume that skips the optimizer's state (Adam's moments
  and step count start afresh; the weights and the schedule are restored);
* ``r3``: rollout routing replay's table shifted by one token (each token replays the routes its
  predecessor took in the engine).

Without PYTEST ARGS a case runs the test files that could see it (its default below), not the
whole suite; pass ``-- tests`` for all of it. The tree is checked out with ``git worktree`` under
a temporary directory and removed afterwards; the tests import it through PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CASES = {
    "sign": ("hapo_openrlhf/algos/advantages.py",
             "    centred = r - mean\n", "    centred = mean - r\n",
             ["tests/algos", "tests/local/test_trainer.py", "tests/integrations/openrlhf/test_experience.py",
              "tests/integrations/openrlhf/test_step_limit.py"]),
    "optimizer": ("hapo_openrlhf/local/trainer.py",
                  '        self.optim.load_state_dict(shard["optimizer"])\n', "",
                  ["tests/local", "tests/test_checkpoint.py", "tests/test_reliability.py"]),
    "r3": ("hapo_openrlhf/integrations/openrlhf/actors/routes.py",
           "            out[b, pos[b][:n]] = routes[:n]\n", "            out[b, pos[b][1:n]] = routes[:n - 1]\n",
           ["tests/integrations/openrlhf/test_routes.py", "tests/integrations/openrlhf/test_megatron_actor.py"]),
}


def run_case(case: str, rev: str, workers: int, pytest_args: list[str]) -> dict:
    path, old, new, default = CASES[case]
    tmp = Path(tempfile.mkdtemp(prefix=f"hapo-break-{case}-"))
    tree = tmp / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
    try:
        target = tree / path
        text = target.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"{case}: the line to break is not in {path} at {rev} exactly once: {old!r}")
        target.write_text(text.replace(old, new))
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
               *(["-n", str(workers)] if workers > 1 else []), *(pytest_args or default)]
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        failed = sorted(set(re.findall(r"^FAILED (\S+)", p.stdout, re.M)))
        summary = (p.stdout.strip().splitlines() or [""])[-1]
        for f in failed:
            print(f"{case}: caught by {f}")
        return {"case": case, "rev": rev, "file": path, "returncode": p.returncode, "failed": failed,
                "summary": summary}
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=[*CASES, "all"], required=True)
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args()
    results = [run_case(c, a.rev, a.workers, a.pytest_args) for c in (CASES if a.case == "all" else [a.case])]
    print(json.dumps(results))
    return 0 if all(r["failed"] for r in results) else 1  # a breakage no test caught is the failure


if __name__ == "__main__":
    sys.exit(main())
