"""Pre-registered comparisons: the verdict rule an experiment file states before its runs.

An experiment file may list ``comparisons`` (``{a: variant, b: variant}``). For each, on
the final held-out Avg@k of every seed both variants finished (runs of one seed share
their warm start, so the difference is paired):

* ``diff`` = mean over seeds of ``final(a) - final(b)``, ``se`` = its standard error
  (sample standard deviation / sqrt(n)), ``ci95`` = ``diff -+ t(0.975, n - 1) * se``;
* **verdict**: ``a > b`` when ``diff > 2 se``, ``a < b`` when ``diff < -2 se``, else
  ``unresolved`` (also with fewer than two seeds);
* ``seeds_needed``: the seeds at which the measured per-seed spread would resolve the
  measured difference at 2 s.e., ``ceil((2 sd / |diff|)^2)`` (a planning figure: it
  takes the measured difference and spread as the truth).

Because both runs of a seed start from the same model, ``final(a) - final(b)`` equals
``gain(a) - gain(b)``.
"""

from __future__ import annotations

import math
from typing import Any

from .stats import RunStats, by_seed, paired

A_WINS, B_WINS, UNRESOLVED = "a > b", "a < b", "unresolved"

# two-sided 95% quantiles of Student's t by degrees of freedom (scipy is not a dependency)
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (table values;
    between tabulated df the next smaller df's, which is conservative; 1.96 past 120)."""
    if df < 1:
        return math.nan
    if df in _T975:
        return _T975[df]
    if df > 120:
        return 1.960
    return _T975[max(k for k in _T975 if k < df)]


def compare(runs: list[RunStats], comparisons: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per comparison whose two variants have runs (the module docstring's rule)."""
    out = []
    for c in comparisons:
        a, b = c["a"], c["b"]
        fa, fb = by_seed(runs, a, lambda r: r.final), by_seed(runs, b, lambda r: r.final)
        if not fa or not fb:
            continue
        t = paired(fa, fb)
        n, d, se = t["n"], t["diff"], t["se"]
        sd = se * math.sqrt(n) if n > 1 else math.nan
        half = t975(n - 1) * se if n > 1 else math.nan
        if n < 2 or math.isnan(se):
            v = UNRESOLVED
        else:
            v = A_WINS if d > 2 * se else B_WINS if d < -2 * se else UNRESOLVED
        need = math.ceil((2 * sd / abs(d)) ** 2) if n > 1 and d and not math.isnan(sd) else None
        out.append({"a": a, "b": b, "n": n, "diff": d, "se": se, "sd": sd, "ci95": [d - half, d + half],
                    "verdict": v, "seeds_needed": need, "per_seed": t["per_seed"],
                    "mean_a": sum(fa.values()) / len(fa), "mean_b": sum(fb.values()) / len(fb)})
    return out


def markdown(rows: list[dict[str, Any]], k: int) -> list[str]:
    """The report's table of :func:`compare` rows."""
    if not rows:
        return ["(no comparison has runs of both variants yet)"]
    lines = [f"| a | b | seeds | Avg@{k} a | Avg@{k} b | a - b | s.e. | 95% interval | verdict (2 s.e.) | "
             f"seeds to resolve |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = "n/a" if math.isnan(r["ci95"][0]) else f"[{r['ci95'][0]:+.4f}, {r['ci95'][1]:+.4f}]"
        se = "n/a" if math.isnan(r["se"]) else f"{r['se']:.4f}"
        lines.append(f"| {r['a']} | {r['b']} | {r['n']} | {r['mean_a']:.4f} | {r['mean_b']:.4f} | "
                     f"{r['diff']:+.4f} | {se} | {ci} | {r['verdict']} | "
                     f"{r['seeds_needed'] if r['seeds_needed'] is not None else 'n/a'} |")
    return lines
