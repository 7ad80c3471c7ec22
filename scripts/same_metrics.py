"""Behaviour unchanged, shown: the embedded trainer's ``metrics.jsonl`` byte for byte against a
base commit (issue 56's redesign is checked against cc53e6b, the last commit before it).

    python scripts/same_metrics.py [--base REV] [--full] [--keep DIR]

For each case (``configs/cpu_tiny.yaml`` and one config of each stateful method: STARE's
controller, PAEC's anchor, EAPO-entropic's kappa decay) it trains twice on this machine, once with
the base commit's code (``git archive REV``, imported through PYTHONPATH) and once with this
tree's, and compares the two ``metrics.jsonl`` line by line, byte for byte (the keys' order included), with
the wall-clock fields (``time/...``) removed. Both runs use the same config file (this tree's) so that only the code
differs. Without ``--full`` the runs are cut to a few steps (warm-up 60, RL 12 with an evaluation
and a checkpoint at 6): enough for every state to be built, checkpointed and observed; ``--full``
trains each config at its shipped size (about 2 minutes a run). Exits 1 naming the first line and
key that differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE = "cc53e6b"  # the last commit before issue 56's redesign
SHORT = ["warmup.steps=60", "trainer.steps=12", "trainer.save_every=6", "trainer.eval_every=6",
         "eval.n_samples=2"]
CASES = {
    "cpu_tiny": ("configs/cpu_tiny.yaml", []),
    "stare": ("configs/cpu_tiny_stare.yaml", []),
    "paec": ("configs/cpu_tiny_paec.yaml", []),
    "less": ("configs/cpu_tiny_less.yaml", []),
    "eapo_decay": ("configs/cpu_tiny_eapo_entropic.yaml", ["algorithm.estimator_params.decay_steps=8"]),
}


def wall_clock(key: str) -> bool:
    return key.startswith("time/")


def train(code: Path, config: Path, out: Path, sets: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "hapo_openrlhf", "train", "--config", str(config), "--output-dir", str(out)]
    for s in sets:
        cmd += ["--set", s]
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(code)}
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (code: {code}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not wall_clock(k)} for line in lines]


def compare(name: str, before: list[dict], after: list[dict]) -> str | None:
    if len(before) != len(after):
        return f"{name}: {len(before)} lines at the base, {len(after)} now"
    for i, (b, a) in enumerate(zip(before, after)):
        if json.dumps(b) == json.dumps(a):  # byte for byte, the keys' order included
            continue
        keys = sorted(set(b) ^ set(a)) or [k for k in sorted(b) if b[k] != a[k]]
        if not keys:
            return f"{name}: line {i + 1} (step {b.get('step')}): the same values, in another key order"
        k = keys[0]
        return f"{name}: line {i + 1} (step {b.get('step')}) differs at {k}: base {b.get(k)!r}, now {a.get(k)!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=BASE, help=f"the commit to compare against (default {BASE})")
    ap.add_argument("--full", action="store_true", help="each config at its shipped size")
    ap.add_argument("--keep", default=None, help="keep the runs under this folder")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="same_metrics.") as tmp:
        work = Path(args.keep or tmp)
        base = work / "base_code"
        if not base.exists():
            base.mkdir(parents=True)
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.base], check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        failures = []
        for name in args.case or sorted(CASES):
            config, sets = CASES[name]
            sets = sets + ([] if args.full else SHORT)
            before = train(base, REPO / config, work / name / "base", sets)
            after = train(REPO, REPO / config, work / name / "now", sets)
            diff = compare(name, before, after)
            print(f"{name}: {'DIFFERS -- ' + diff if diff else f'identical ({len(after)} lines)'}", flush=True)
            if diff:
                failures.append(diff)
    print(f"same_metrics: {len(CASES) - len(failures) if not args.case else len(args.case) - len(failures)} "
          f"identical, {len(failures)} differ (base {args.base})")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
