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

Several warm starts (issue 60): when the RL seeds are nested in W >= 2 warm starts
(``warm_starts`` in the experiment file), the unit of the analysis is the warm start, as a
two-level mean: the paired differences are averaged within each warm start, ``diff`` is the mean
of those W means, ``se`` their sample standard deviation / sqrt(W), the interval and p on W - 1
degrees of freedom, and ``seeds_needed`` counts warm starts (``unit``). Warm starts weigh
equally whatever their seed counts. This s.e. carries the warm starts' luck, which the paired
per-seed s.e. of one shared warm start cannot (its verdicts are conditional on that model); with a
warm start per seed the two are the same computation. (A mixed model would use the within-start
spread too; with a handful of warm starts the two-level mean is the robust choice, and the one a
reader can recompute.)

Multiplicity (issue 60): each row also carries ``p``, the two-sided p-value of the paired t
statistic ``diff / se`` on n - 1 degrees of freedom, and :func:`holm` gives **Holm's step-down
verdict** over a family of comparisons (the pre-registered ones) at the family-wise level the
experiment file names (``familywise_alpha``, default 0.05): sorted by p, the i-th smallest (from
0) is rejected while p <= alpha / (m - i); the first that is not stops the procedure, and it and
every larger p are unresolved. A rejected comparison's direction is its difference's sign.
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


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom: I_{df / (df + t^2)}(df / 2, 1 / 2)."""
    if df < 1 or math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0
    return _betainc(df / 2.0, 0.5, df / (df + t * t))


def check_alpha(alpha: Any, where: str) -> float:
    """``familywise_alpha``, a number in (0, 1), or a ValueError naming ``where`` it was read."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"{where}: familywise_alpha must be a number in (0, 1) (the family-wise level of Holm's "
                         f"verdicts over the comparisons), got {alpha!r}")
    return float(alpha)


def holm(rows: list[dict[str, Any]], alpha: float) -> list[dict[str, Any]]:
    """Holm's step-down verdicts over ``rows`` (one family; each with ``p`` and ``diff``): each row
    gets ``holm`` (a > b / a < b / unresolved), ``holm_threshold`` (alpha / (m - rank)) and
    ``holm_why`` (the reason, for the report: ``p <= t``, ``p > t``, ``stopped at a smaller p``, ``no
    p-value``). Rows without a p-value (fewer than two seeds) are unresolved and count in m."""
    m = len(rows)
    order = sorted(range(m), key=lambda i: (math.isnan(rows[i]["p"]), rows[i]["p"]))
    stopped = False
    for rank, i in enumerate(order):
        r = rows[i]
        t = r["holm_threshold"] = alpha / (m - rank)
        if not stopped and not math.isnan(r["p"]) and r["p"] <= t and r["diff"] != 0:
            r["holm"], r["holm_why"] = (A_WINS if r["diff"] > 0 else B_WINS), f"p <= {t:.4f}"
        else:
            r["holm"] = UNRESOLVED
            r["holm_why"] = ("no p-value" if math.isnan(r["p"]) else
                             "stopped at a smaller p" if stopped else f"p > {t:.4f}" if r["p"] > t else "a - b = 0")
            stopped = True
    return rows


def _two_level(fa: dict[int, float], fb: dict[int, float], clusters: dict[int, Any]) -> dict[str, Any]:
    """The paired differences averaged within each warm start, then over warm starts (docstring)."""
    per: dict[Any, list[float]] = {}
    for s in sorted(set(fa) & set(fb)):
        if not (math.isnan(fa[s]) or math.isnan(fb[s])):
            per.setdefault(clusters[s], []).append(fa[s] - fb[s])
    means = [sum(v) / len(v) for v in per.values()]
    W = len(means)
    d = sum(means) / W if W else math.nan
    se = math.sqrt(sum((m - d) ** 2 for m in means) / (W - 1)) / math.sqrt(W) if W > 1 else math.nan
    return {"diff": d, "se": se, "units": W, "n": sum(map(len, per.values())),
            "per_seed": [x for v in per.values() for x in v], "per_warm_start": dict(zip(map(str, per), means))}


def compare(runs: list[RunStats], comparisons: list[dict[str, Any]],
            clusters: dict[int, Any] | None = None) -> list[dict[str, Any]]:
    """One row per comparison whose two variants have runs (the module docstring's rule).
    ``clusters``: RL seed -> its warm start; with two or more warm starts holding some seed
    more than once the analysis is the two-level mean over warm starts."""
    out = []
    for c in comparisons:
        a, b = c["a"], c["b"]
        fa, fb = by_seed(runs, a, lambda r: r.final), by_seed(runs, b, lambda r: r.final)
        if not fa or not fb:
            continue
        seeds = set(fa) & set(fb)
        starts = {clusters[s] for s in seeds} if clusters else set()
        nested = len(starts) >= 2 and len(starts) < len(seeds)
        if nested:
            t = _two_level(fa, fb, clusters)
            units, unit = t["units"], "warm start"
        else:
            t = paired(fa, fb)
            units, unit = t["n"], "seed"
        n, d, se = units, t["diff"], t["se"]
        sd = se * math.sqrt(n) if n > 1 else math.nan
        half = t975(n - 1) * se if n > 1 else math.nan
        if n < 2 or math.isnan(se):
            v = UNRESOLVED
        else:
            v = A_WINS if d > 2 * se else B_WINS if d < -2 * se else UNRESOLVED
        need = math.ceil((2 * sd / abs(d)) ** 2) if n > 1 and d and not math.isnan(sd) else None
        if n < 2 or math.isnan(se):
            p = math.nan
        elif se == 0:  # every seed's difference the same: none (p 1) or a certain one (p 0)
            p = 0.0 if d else 1.0
        else:
            p = t_two_sided_p(d / se, n - 1)
        out.append({"a": a, "b": b, "n": n, "unit": unit, "seeds": t["n"] if nested else n, "diff": d, "se": se,
                    "sd": sd, "ci95": [d - half, d + half], **({"per_warm_start": t["per_warm_start"]} if nested else {}),
                    "verdict": v, "p": p, "seeds_needed": need, "per_seed": t["per_seed"],
                    "mean_a": sum(fa.values()) / len(fa), "mean_b": sum(fb.values()) / len(fb)})
    return out


def markdown(rows: list[dict[str, Any]], k: int, alpha: float | None = None) -> list[str]:
    """The report's table of :func:`compare` rows; with ``alpha``, the rows are one family and
    Holm's verdicts (:func:`holm`) are a column beside the 2-s.e. ones."""
    if not rows:
        return ["(no comparison has runs of both variants yet)"]
    holm_col = alpha is not None
    if holm_col:
        holm(rows, alpha)
    lines = [f"| a | b | seeds | Avg@{k} a | Avg@{k} b | a - b | s.e. | 95% interval | p | verdict (2 s.e.) | "
             + (f"Holm (family-wise {alpha:g}) | " if holm_col else "") + "seeds to resolve |",
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if holm_col else "") + "---|"]
    for r in rows:
        ci = "n/a" if math.isnan(r["ci95"][0]) else f"[{r['ci95'][0]:+.4f}, {r['ci95'][1]:+.4f}]"
        se = "n/a" if math.isnan(r["se"]) else f"{r['se']:.4f}"
        p = "n/a" if math.isnan(r["p"]) else f"{r['p']:.4f}"
        hv = (f"{r['holm']} ({r['holm_why']}) | " if holm_col else "")
        n = f"{r['n']} warm starts x {r['seeds']} seeds" if r.get("unit") == "warm start" else r["n"]
        lines.append(f"| {r['a']} | {r['b']} | {n} | {r['mean_a']:.4f} | {r['mean_b']:.4f} | "
                     f"{r['diff']:+.4f} | {se} | {ci} | {p} | {r['verdict']} | {hv}"
                     f"{r['seeds_needed'] if r['seeds_needed'] is not None else 'n/a'}"
                     f"{_warm_starts(r['seeds_needed']) if r.get('unit') == 'warm start' else ''} |")
    return lines


def _warm_starts(n: int | None) -> str:
    """The unit after a warm-start count: ' warm start' / ' warm starts' (nothing without a count)."""
    return "" if n is None else " warm start" if n == 1 else " warm starts"
