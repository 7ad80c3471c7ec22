"""The paper's qualitative findings as checks on an experiment's runs.

Each check is a paired comparison over seeds (runs of one seed share a warm start)
with one fixed rule: **agree** when the mean per-seed difference points the way the
paper says and exceeds twice its standard error, **disagree** when it points the
other way by as much, **inconclusive** otherwise (or with fewer than two seeds).
With three seeds this is a screen for a consistent direction, not a significance
test; the numbers are printed next to every verdict.

The claims are those of arXiv 2604.11056v1 (section 4, Tables 3-4; SPEC.md 2.3-2.4);
``reading`` states how each is operationalised at toy scale, where Avg@k / Pass@k are
held-out accuracies of the tiny model (k = 4), not the paper's six benchmarks.
"""

from __future__ import annotations

import math
from typing import Callable

from .stats import RunStats, by_seed, paired

Metric = Callable[[RunStats], float]
AGREE, DISAGREE, INCONCLUSIVE = "agree", "disagree", "inconclusive"


def verdict(test: dict, direction: int = 1) -> str:
    d, se = test["diff"], test["se"]
    if test["n"] < 2 or math.isnan(d) or math.isnan(se):
        return INCONCLUSIVE
    if direction * d > 2 * se:
        return AGREE
    if direction * d < -2 * se:
        return DISAGREE
    return INCONCLUSIVE


def _mean_of(runs: list[RunStats], variants: list[str], metric: Metric) -> dict[int, float]:
    """seed -> mean of ``metric`` over ``variants`` (seeds where all are present)."""
    per = [by_seed(runs, v, metric) for v in variants]
    seeds = set.intersection(*(set(p) for p in per)) if per else set()
    return {s: sum(p[s] for p in per) / len(per) for s in seeds}


def _const(runs: list[RunStats], value: float) -> dict[int, float]:
    return {r.seed: value for r in runs}


def _combine(verdicts: list[str]) -> str:
    if DISAGREE in verdicts:
        return DISAGREE
    return AGREE if verdicts and all(v == AGREE for v in verdicts) else INCONCLUSIVE


def _fmt(t: dict) -> str:
    return f"{t['diff']:+.3f} ± {t['se']:.3f} (n={t['n']})"


def _dynamics_findings(runs: list[RunStats], have: set[str], add) -> None:
    """The paper's claims about entropy and learning speed (the quadrant runs, HAPO against GRPO)."""
    ratio: Metric = lambda r: r.entropy_ratio  # noqa: E731
    q_other = ["quadrant_phr", "quadrant_nhr", "quadrant_nlr"]
    add("plr_entropy_collapse", "Training only on PLR tokens collapses entropy.",
        "PLR's end/start entropy ratio (mean of the last vs first 10 steps' behaviour entropy) is below 1 "
        "and below the mean ratio of the other three quadrant runs.",
        ["quadrant_plr", *q_other],
        lambda: [("1 - ratio(PLR)", paired(_const(runs, 1.0), by_seed(runs, "quadrant_plr", ratio)), 1),
                 ("ratio(other quadrants) - ratio(PLR)",
                  paired(_mean_of(runs, q_other, ratio), by_seed(runs, "quadrant_plr", ratio)), 1)])
    add("plr_early_saturation", "PLR gains early, then saturates.",
        "PLR's early gain (mean Avg@k over the first half's evaluations minus the warm start's) is > 0, and "
        "its late gain (second half's mean minus first half's) is below that of PHR and NHR.",
        ["quadrant_plr", "quadrant_phr", "quadrant_nhr"],
        lambda: [("early gain(PLR)", paired(by_seed(runs, "quadrant_plr", lambda r: r.early_gain),
                                            _const(runs, 0.0)), 1),
                 ("late gain(PHR, NHR) - late gain(PLR)",
                  paired(_mean_of(runs, ["quadrant_phr", "quadrant_nhr"], lambda r: r.late_gain),
                         by_seed(runs, "quadrant_plr", lambda r: r.late_gain)), 1)])
    add("nhr_faster_than_nlr", "NHR converges faster than NLR (paper: about 1.5x).",
        "NHR's early gain (first half of RL) exceeds NLR's.",
        ["quadrant_nhr", "quadrant_nlr"],
        lambda: [("early gain(NHR) - early gain(NLR)",
                  paired(by_seed(runs, "quadrant_nhr", lambda r: r.early_gain),
                         by_seed(runs, "quadrant_nlr", lambda r: r.early_gain)), 1)])
    add("phr_nhr_sustained", "PHR and NHR (high-entropy tokens) give sustained gains.",
        "The late gain of PHR and of NHR is > 0 (still improving in the second half).",
        ["quadrant_phr", "quadrant_nhr"],
        lambda: [(f"late gain({q[-3:].upper()})", paired(by_seed(runs, q, lambda r: r.late_gain),
                                                         _const(runs, 0.0)), 1)
                 for q in ("quadrant_phr", "quadrant_nhr")])
    add("hapo_entropy_stable", "HAPO keeps entropy stable where GRPO collapses it.",
        "HAPO's end/start entropy ratio exceeds GRPO's, and GRPO's is below 1. (DAPO, HAPO's base, is "
        "compared too when present.)",
        ["hapo", "grpo"],
        lambda: [("ratio(HAPO) - ratio(GRPO)", paired(by_seed(runs, "hapo", ratio), by_seed(runs, "grpo", ratio)), 1),
                 ("1 - ratio(GRPO)", paired(_const(runs, 1.0), by_seed(runs, "grpo", ratio)), 1)]
        + ([("ratio(HAPO) - ratio(DAPO)", paired(by_seed(runs, "hapo", ratio), by_seed(runs, "dapo", ratio)), 1)]
           if "dapo" in have else []))


def _accuracy_findings(runs: list[RunStats], have: set[str], add) -> None:
    """The paper's claims about final accuracy (the alpha sweep, the ablations, the baselines) and our
    check of the published rule against the reconstruction."""
    final: Metric = lambda r: r.final  # noqa: E731

    def no_worse(t: dict, tol: float = 0.03) -> str:
        if t["n"] < 2 or math.isnan(t["se"]):
            return INCONCLUSIVE
        if t["diff"] < -2 * t["se"] and t["diff"] < -tol:
            return DISAGREE
        return AGREE if abs(t["diff"]) <= tol else INCONCLUSIVE

    sweep = [a for a in ("0.1", "0.4", "1.0") if f"hapo_alpha{a}" in have]
    add("alpha_robust", "HAPO is robust to alpha (paper, 7B average: 0.1 48.0, 0.2 48.6, 0.4 47.8, 1.0 47.6).",
        "No swept alpha ends with a lower Avg@k than alpha 0.2 by more than twice the standard error and "
        "more than 0.03 (disagree); each within 0.03 of alpha 0.2 (agree).",
        ["hapo", "hapo_alpha0.1", "hapo_alpha0.4"],
        lambda: [(f"Avg@k(alpha {a}) - Avg@k(alpha 0.2)",
                  paired(by_seed(runs, f"hapo_alpha{a}", final), by_seed(runs, "hapo", final)), no_worse)
                 for a in sweep])
    ablated = [q for q in ("phr", "plr", "nhr", "nlr") if f"hapo_ablate_{q}" in have]
    add("hapo_ablation_hurts", "Removing HAPO's shaping from any quadrant lowers accuracy "
        "(paper: full 48.6; without PHR 47.4, PLR 48.1, NLR 47.7, NHR 47.2).",
        "Final Avg@k of full HAPO minus that of each ablation (that quadrant's tokens keep the plain "
        "advantage), per seed.",
        ["hapo", "hapo_ablate_phr"],
        lambda: [(f"Avg@k(HAPO) - Avg@k(without {q.upper()})",
                  paired(by_seed(runs, "hapo", final), by_seed(runs, f"hapo_ablate_{q}", final)), 1)
                 for q in ablated])
    add("phr_beats_plr", "PHR ends above PLR (paper: PLR needs about 5.5x PHR's steps and trails it by 12% "
        "Pass@32), and PLR falls below the base model's Pass@k.",
        "PHR's final Avg@k minus PLR's, and the warm start's Pass@k minus PLR's final Pass@k, per seed.",
        ["quadrant_phr", "quadrant_plr"],
        lambda: [("Avg@k(PHR) - Avg@k(PLR)", paired(by_seed(runs, "quadrant_phr", final),
                                                    by_seed(runs, "quadrant_plr", final)), 1),
                 ("Pass@k(warm start) - Pass@k(PLR)",
                  paired(by_seed(runs, "quadrant_plr", lambda r: r.pass_[0]),
                         by_seed(runs, "quadrant_plr", lambda r: r.final_pass)), 1)])
    add("published_vs_multiplicative", "Our check, not a paper claim: the published additive rule does no "
        "worse than the pre-publication multiplicative reconstruction.",
        "Final Avg@k of HAPO (published) minus HAPO (multiplicative), same seeds and warm starts; within 0.03 "
        "agrees, lower by more than 0.03 and twice the standard error disagrees.",
        ["hapo", "hapo_multiplicative"],
        lambda: [("Avg@k(published) - Avg@k(multiplicative)",
                  paired(by_seed(runs, "hapo", final), by_seed(runs, "hapo_multiplicative", final)), no_worse)])
    add("hapo_beats_baselines", "HAPO reaches a higher Avg@k than GRPO and DAPO.",
        "Final held-out Avg@k of HAPO minus that of GRPO and of DAPO, per seed.",
        ["hapo", "grpo", "dapo"],
        lambda: [(f"Avg@k(HAPO) - Avg@k({b.upper()})", paired(by_seed(runs, "hapo", final), by_seed(runs, b, final)), 1)
                 for b in ("grpo", "dapo")])


def evaluate_findings(runs: list[RunStats]) -> list[dict]:
    """One entry per finding whose variants are all present in ``runs``."""
    have = {r.variant for r in runs}
    out: list[dict] = []

    def add(fid, claim, reading, needs, tests):
        """tests: [(label, paired-test dict, rule)]; rule: +1 / -1 (the direction the paper
        claims, see ``verdict``) or a function of the test dict returning a verdict"""
        if not set(needs) <= have:
            return
        rows = [{"label": lab, **t, "verdict": rule(t) if callable(rule) else verdict(t, rule)}
                for lab, t, rule in tests()]
        out.append({"id": fid, "claim": claim, "reading": reading, "tests": rows,
                    "verdict": _combine([r["verdict"] for r in rows]),
                    "evidence": "; ".join(f"{r['label']}: {_fmt(r)} -> {r['verdict']}" for r in rows)})

    _dynamics_findings(runs, have, add)
    _accuracy_findings(runs, have, add)
    return out
