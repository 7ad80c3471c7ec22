"""Per-run summaries of an experiment's runs and their spread over seeds.

Every figure in the experiment report comes from these functions, so the
report, ``findings.json`` and docs/reproduction.md quote the same numbers.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..algos.quadrants import QUADRANTS
from ..rundir.logger import read_metrics
from .credit import credit_counts, run_samples

WINDOW = 10  # steps averaged for "entropy at the start / end"
# each quadrant's per-step metrics the report reads (its share and entropy tables and plots); the
# results file keeps these and no others
QUADRANT_STATS = ("token_frac", "entropy_mean")


@dataclass
class RunStats:
    variant: str
    seed: int
    k: int
    steps: int
    eval_steps: list[int]
    avg: list[float]  # Avg@k at eval_steps (step 0 = the warm start)
    pass_: list[float]
    train_steps: list[int]
    entropy: list[float]  # behaviour entropy of each step's rollout batch
    quadrant: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # q -> stat -> per step
    wall_s: float | None = None
    # the token-credit counts of its dumped samples (credit.credit_counts); None: no samples dumped or kept
    credit: dict[str, dict[str, float]] | None = None
    # the code it ran with (registration.run_code; the runner's jobs record); None: not recorded (older runs)
    code: dict | None = None

    # ---- derived scalars (the report's columns)
    @property
    def before(self) -> float:
        return self.avg[0]

    @property
    def final(self) -> float:
        return self.avg[-1]

    @property
    def final_pass(self) -> float:
        return self.pass_[-1]

    @property
    def gain(self) -> float:
        return self.final - self.before

    def _half(self, second: bool) -> list[float]:
        h = self.steps / 2
        return [a for s, a in zip(self.eval_steps, self.avg) if s > 0 and ((s > h) if second else (s <= h))]

    @property
    def early_gain(self) -> float:
        """Mean Avg@k over the evaluations in the first half of RL, minus the warm start's."""
        first = self._half(False)
        return _mean(first) - self.before if first else math.nan

    @property
    def late_gain(self) -> float:
        """Mean Avg@k over the second half's evaluations minus the first half's: > 0 while
        a run keeps improving, <= 0 once it has saturated (or degrades)."""
        first, second = self._half(False), self._half(True)
        return _mean(second) - _mean(first) if first and second else math.nan

    @property
    def entropy_start(self) -> float:
        return _mean(self.entropy[:WINDOW])

    @property
    def entropy_end(self) -> float:
        return _mean(self.entropy[-WINDOW:])

    @property
    def entropy_ratio(self) -> float:
        return self.entropy_end / self.entropy_start

    def quadrant_mean(self, q: str, stat: str, last: int | None = None) -> float:
        xs = [x for x in self.quadrant.get(q, {}).get(stat, []) if x is not None]
        return _mean(xs[-last:] if last else xs)


def _mean(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else math.nan


def spread(values: list[float]) -> dict[str, float]:
    """mean, sample std (ddof 1), min, max and n of ``values`` (NaNs dropped)."""
    xs = [v for v in values if not math.isnan(v)]
    n = len(xs)
    m = sum(xs) / n if n else math.nan
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else math.nan
    return {"mean": m, "std": sd, "min": min(xs) if xs else math.nan, "max": max(xs) if xs else math.nan, "n": n}


def paired(a: dict[int, float], b: dict[int, float]) -> dict[str, float]:
    """Mean and standard error of the per-seed difference a - b (runs of one seed share
    their warm start, so the pairing removes the warm start's luck)."""
    seeds = sorted(set(a) & set(b))
    d = [a[s] - b[s] for s in seeds if not (math.isnan(a[s]) or math.isnan(b[s]))]
    sp = spread(d)
    se = sp["std"] / math.sqrt(sp["n"]) if sp["n"] > 1 else math.nan
    return {"diff": sp["mean"], "se": se, "n": sp["n"], "per_seed": d}


def load_run(run_dir: str | Path, variant: str, seed: int, wall_s: float | None = None,
             code: dict | None = None) -> RunStats:
    recs = read_metrics(run_dir)
    evals = [r for r in recs if any(k.startswith("eval/avg@") for k in r)]
    if not evals:
        raise ValueError(f"{str(run_dir)!r} has no held-out evaluation in metrics.jsonl")
    k = int(next(re.match(r"eval/avg@(\d+)", key).group(1) for key in evals[0] if key.startswith("eval/avg@")))
    train = [r for r in recs if "reward/mean" in r]
    quad = {q: {stat: [r.get(f"quadrant/{q}/{stat}") for r in train]
                for stat in QUADRANT_STATS} for q in QUADRANTS}
    return RunStats(
        variant=variant, seed=seed, k=k, steps=max((r["step"] for r in recs), default=0),
        eval_steps=[r["step"] for r in evals], avg=[r[f"eval/avg@{k}"] for r in evals],
        pass_=[r[f"eval/pass@{k}"] for r in evals], train_steps=[r["step"] for r in train],
        entropy=[r["actor/entropy"] for r in train], quadrant=quad, wall_s=wall_s,
        credit=credit_counts(samples) if (samples := run_samples(run_dir)) else None,
        code=code,
    )


def by_seed(runs: list[RunStats], variant: str, metric) -> dict[int, float]:
    """seed -> ``metric(run)`` for the runs of ``variant``."""
    return {r.seed: metric(r) for r in runs if r.variant == variant}
