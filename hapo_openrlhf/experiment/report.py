"""The experiment report: Markdown + PNGs + findings.json from an experiment directory.

``hapo report EXPERIMENT_DIR`` (or the end of ``hapo experiment``) reads
``experiment.json`` and each finished run's ``metrics.jsonl``; nothing is
recomputed from models.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..algos.quadrants import QUADRANTS
from ..rundir.jsonfile import read_json_object
from ..report.plots import moving_average, save_png
from .credit import credit_from_counts
from .registration import ARITHMETIC_KEYS, SOURCE_KEYS, check_jobs, code_difference
from .credit import markdown as credit_markdown
from .findings import evaluate_findings
from .verdicts import compare
from .verdicts import check_alpha, holm
from .verdicts import markdown as verdict_table
from .stats import RunStats, load_run, spread

QUADRANT_VIEW = ("quadrant_phr", "quadrant_plr", "quadrant_nhr", "quadrant_nlr", "grpo", "dapo", "hapo")


def is_experiment_dir(path: str | Path) -> bool:
    return (Path(path) / "experiment.json").exists()


def load_experiment_runs(exp_dir: str | Path) -> tuple[dict, list[RunStats], list[str]]:
    """(manifest, stats of every finished run of the suites that were run, missing runs)."""
    exp_dir = Path(exp_dir)
    manifest = read_manifest(exp_dir / "experiment.json")
    variants: list[str] = []
    for s in suites_run(manifest):
        variants += [v for v in manifest["suites"][s] if v not in variants]
    runs, missing = [], []
    for v in variants:
        for seed in manifest["seeds"]:
            name = f"{v}/seed_{seed}"
            d = Path(manifest["runs"][name])
            if not (d / "summary.json").exists():
                missing.append(name)
                continue
            job = manifest.get("jobs", {}).get(name, {})
            code = job.get("code")
            runs.append(load_run(d, v, seed, job.get("wall_s"), code if isinstance(code, dict) else None))
    return manifest, runs, missing


def read_manifest(path: Path) -> dict:
    """``experiment.json`` with the fields the report reads checked: a damaged one is an
    error naming the file and the field, not a KeyError halfway through the report."""
    m = read_json_object(path, "the experiment's manifest")
    suites, seeds, runs = m.get("suites"), m.get("seeds"), m.get("runs")
    if not (isinstance(suites, dict) and all(isinstance(v, list) for v in suites.values())):
        raise ValueError(f"{path}: 'suites' must map each suite to its list of variants")
    if not (isinstance(seeds, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        raise ValueError(f"{path}: 'seeds' must be a list of integers")
    if not (isinstance(runs, dict) and all(isinstance(v, str) for v in runs.values())):
        raise ValueError(f"{path}: 'runs' must map each run name to its directory")
    if not isinstance(m.get("suites_run", []), list) or not isinstance(m.get("jobs", {}), dict):
        raise ValueError(f"{path}: 'suites_run' must be a list and 'jobs' an object")
    check_jobs(m, path)
    comps = m.get("comparisons", [])
    if not (isinstance(comps, list) and all(isinstance(c, dict) and set(c) == {"a", "b"}
                                            and all(isinstance(c[x], str) for x in "ab") for c in comps)):
        raise ValueError(f"{path}: 'comparisons' must be a list of {{a: variant, b: variant}}")
    reg, added = m.get("registration"), m.get("comparisons_added", [])
    if reg is not None and not (isinstance(reg, dict) and isinstance(reg.get("at"), str)
                                and isinstance(reg.get("comparisons"), list)):
        raise ValueError(f"{path}: 'registration' must be an object with 'at' and 'comparisons'")
    for c in (reg or {}).get("comparisons", []) + (added if isinstance(added, list) else [None]):
        if not (isinstance(c, dict) and isinstance(c.get("a"), str) and isinstance(c.get("b"), str)):
            raise ValueError(f"{path}: a registered or added comparison must be {{a: variant, b: variant}}, got {c!r}")
    missing = sorted({f"{v}/seed_{s}" for vs in suites.values() for v in vs for s in seeds} - set(runs))
    if missing:
        raise ValueError(f"{path}: 'runs' lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return m


def _code_lines(manifest: dict, runs: list[RunStats] = ()) -> list[str]:
    """The code the experiment was registered with, each run's against it, and every later
    invocation's named change."""
    code = (manifest.get("registration") or {}).get("code")
    if not isinstance(code, dict):
        return []
    commit = code.get("git_commit")
    where = (f"git commit {commit[:12]}" + (" with uncommitted changes" if code.get("git_dirty") else "")
             if isinstance(commit, str) else "no git checkout")
    arith = (f"; CPU arithmetic {code['cpu_capability']} ({code.get('cpu_model', '?')})" if "cpu_capability" in code
             else "; the CPU arithmetic not recorded (a registration before it was)")
    lines = [f"Registered code: {where}; package sources sha256 {str(code.get('sources_sha256', '?'))[:16]}...; "
             f"torch {code.get('torch', '?')}, transformers {code.get('transformers', '?')}{arith}.", ""]
    lines += _run_code_lines(code, runs, manifest.get("code_changes") or [])
    for c in manifest.get("code_changes") or []:
        if isinstance(c, dict):
            lines += [f"**Code changed after the registration** ({c.get('at')}; `--code-change`): "
                      f"{'; '.join(map(str, c.get('differences', [])))}. Reason given: {c.get('reason')!r}.", ""]
    return lines


def _run_code_lines(registered: dict, runs: list[RunStats], changes: list) -> list[str]:
    """Each finished run's recorded code against the registered (package sources, torch, transformers;
    the CPU arithmetic, where both record it)."""
    if not runs:
        return []

    def named(xs):
        return ", ".join(xs[:6]) + (f" and {len(xs) - 6} more" if len(xs) > 6 else "")

    recorded = [(f"{r.variant}/seed_{r.seed}", r.code) for r in runs if r.code is not None]
    other = [name for name, code in recorded if code_difference(registered, code, SOURCE_KEYS)]
    arith = [name for name, code in recorded
             if name not in other and code_difference(registered, code, ARITHMETIC_KEYS)]
    unrecorded = sum(r.code is None for r in runs)
    same = len(runs) - len(other) - len(arith) - unrecorded
    text = f"Each run's code: {same} of {len(runs)} finished runs recorded the registered code"
    if other:
        text += f"; **{len(other)} ran from other code**: " + named(other)
    if arith:
        text += (f"; **{len(arith)} ran on other CPU arithmetic** (the same code computes other numbers there): "
                 + named(arith))
    if unrecorded:
        text += (f"; {unrecorded} finished before runs recorded their code (each invocation that ran them was "
                 f"checked against the registration: {len(changes)} code change(s) recorded)")
    return [text + ".", ""]


def warm_start_of_seed(manifest: dict) -> dict[int, int]:
    """RL seed -> its warm start's seed: nested (``warm_start_of_seed``), one shared, or its own."""
    nested = manifest.get("warm_start_of_seed")
    if isinstance(nested, dict):
        return {int(k): v for k, v in nested.items()}
    ws = manifest.get("warm_start_seed")
    return {s: (ws if ws is not None else s) for s in manifest.get("seeds", [])}


def familywise_alpha(manifest: dict) -> float:
    """The family-wise level Holm's verdicts use: the registration's (frozen with the comparisons),
    else the file's, else 0.05."""
    reg = manifest.get("registration") or {}
    return check_alpha(reg.get("familywise_alpha", manifest.get("familywise_alpha", 0.05)), "experiment.json")


def comparison_sets(manifest: dict) -> tuple[list[dict], list[dict], str | None]:
    """(pre-registered comparisons, comparisons added after the runs started (each with its
    ``at``), the registration time). A manifest written before registration was recorded
    has no time, and its comparisons are reported as stated in the file."""
    reg = manifest.get("registration")
    if reg is None:
        return [dict(c) for c in manifest.get("comparisons") or []], [], None
    pair = lambda c: (c["a"], c["b"])  # noqa: E731
    registered = [{"a": c["a"], "b": c["b"]} for c in reg["comparisons"]]
    added = [dict(c) for c in manifest.get("comparisons_added", [])]
    known = {pair(c) for c in registered + added}
    added += [{"a": c["a"], "b": c["b"], "at": "unknown (not recorded by the runner)"}
              for c in manifest.get("comparisons") or [] if pair(c) not in known]
    if reg.get("recorded_after_runs"):  # first recorded on a manifest whose runs predate registration
        return registered + [{"a": c["a"], "b": c["b"]} for c in added], [], None
    return registered, added, reg["at"]


def credit_table(runs: list[RunStats], variants: list[str]) -> dict[str, dict]:
    """variant -> :func:`~.credit.credit_from_counts` of its finished runs' token-credit counts, all
    seeds pooled (variants none of whose runs has them are left out). The same from the run
    directories and from a results file, which keeps each run's counts."""
    out = {}
    for v in dict.fromkeys(variants):
        counts = [r.credit for r in runs if r.variant == v and r.credit is not None]
        if counts:
            out[v] = credit_from_counts(counts)
    return out


def suites_run(manifest: dict) -> list[str]:
    """The suites run so far, in the experiment file's order."""
    return [s for s in manifest["suites"] if s in manifest.get("suites_run", [])]


def _f(x: float, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _ms(s: dict[str, float], nd: int = 3) -> str:
    """'mean ± std' of a ``spread`` dict."""
    return _f(s["mean"], nd) + ("" if math.isnan(s["std"]) else f" ± {_f(s['std'], nd)}")


def variant_table(runs: list[RunStats], variants: list[str]) -> dict[str, dict]:
    """variant -> {metric: spread over seeds} (the numbers behind the report's tables)."""
    out = {}
    for v in variants:
        rs = [r for r in runs if r.variant == v]
        if not rs:
            continue
        row = {name: spread([fn(r) for r in rs]) for name, fn in {
            "avg_before": lambda r: r.before, "avg_final": lambda r: r.final, "pass_final": lambda r: r.final_pass,
            "gain": lambda r: r.gain, "early_gain": lambda r: r.early_gain, "late_gain": lambda r: r.late_gain,
            "entropy_start": lambda r: r.entropy_start, "entropy_end": lambda r: r.entropy_end,
            "entropy_ratio": lambda r: r.entropy_ratio,
        }.items()}
        for q in QUADRANTS:
            row[f"{q}_share"] = spread([r.quadrant_mean(q, "token_frac") for r in rs])
            row[f"{q}_entropy_end"] = spread([r.quadrant_mean(q, "entropy_mean", last=10) for r in rs])
        row["k"] = rs[0].k
        row["seeds"] = sorted(r.seed for r in rs)
        out[v] = row
    return out


def _plots(runs: list[RunStats], suites: dict[str, list[str]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []

    def band(ax, xs_list, ys_list, label):
        """Mean over seeds with the min-max band (curves aligned on their common steps)."""
        common = sorted(set.intersection(*(set(x) for x in xs_list)))
        if not common:
            return
        cols = [[dict(zip(x, y))[s] for x, y in zip(xs_list, ys_list)] for s in common]
        m = [sum(c) / len(c) for c in cols]
        (line,) = ax.plot(common, m, lw=1.6, label=label)
        if len(xs_list) > 1:
            ax.fill_between(common, [min(c) for c in cols], [max(c) for c in cols], color=line.get_color(), alpha=0.15)

    def smooth(ys):
        return moving_average(ys, 5)

    def save(fig, name):
        save_png(fig, out, name, written, dpi=100)

    k = runs[0].k
    for key, title in (("avg", f"held-out Avg@{k}"), ("pass_", f"held-out Pass@{k}"), ("entropy", "entropy")):
        fig, axes = plt.subplots(1, len(suites), figsize=(5.2 * len(suites), 3.8), squeeze=False)
        for ax, (suite, variants) in zip(axes[0], suites.items()):
            for v in variants:
                rs = [r for r in runs if r.variant == v]
                if not rs:
                    continue
                if key == "entropy":
                    band(ax, [r.train_steps for r in rs], [smooth(r.entropy) for r in rs], v)
                else:
                    band(ax, [r.eval_steps for r in rs], [getattr(r, key) for r in rs], v)
            ax.set(title=f"{suite}: {title}" + (" (5-step moving average, log scale)" if key == "entropy" else ""),
                   xlabel="RL step")
            if key == "entropy":  # runs can differ by orders of magnitude (a collapsing or exploding run)
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
        save(fig, {"avg": "avg_at_k", "pass_": "pass_at_k", "entropy": "entropy"}[key])
    view = [v for v in QUADRANT_VIEW if any(r.variant == v for r in runs)]
    for stat, name, title in (("entropy_mean", "quadrant_entropy", "mean entropy"),
                              ("token_frac", "quadrant_share", "token share")):
        fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
        for ax, q in zip(axes.flat, QUADRANTS):
            for v in view:
                rs = [r for r in runs if r.variant == v]
                ys = [smooth([x if x is not None else math.nan for x in r.quadrant[q][stat]]) for r in rs]
                band(ax, [r.train_steps for r in rs], ys, v)
            ax.set_title(f"{q}: {title} (5-step moving average{', log scale' if stat == 'entropy_mean' else ''})",
                         fontsize=9)
            if stat == "entropy_mean":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0, 0].legend(fontsize=6)
        axes[1, 0].set_xlabel("RL step")
        axes[1, 1].set_xlabel("RL step")
        save(fig, name)
    return written


def _suite_tables(suites: dict, table: dict, k: int) -> list[str]:
    """One Markdown table per suite: each variant's accuracy, gains, entropy and quadrant shares."""
    lines: list[str] = []
    for suite, vs in suites.items():
        lines += [f"## {suite}", "",
                  f"| variant | Avg@{k} before | Avg@{k} final | Pass@{k} final | gain | early gain | late gain | "
                  "entropy start → end | entropy ratio | share PHR/PLR/NHR/NLR |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for v in vs:
            if v not in table:
                lines.append(f"| {v} | (no finished run) |||||||||")
                continue
            t = table[v]
            share = "/".join(_f(t[f"{q}_share"]["mean"], 2) for q in QUADRANTS)
            lines.append(
                f"| {v} | {_ms(t['avg_before'])} | {_ms(t['avg_final'])} | {_ms(t['pass_final'])} | "
                f"{_ms(t['gain'])} | {_ms(t['early_gain'])} | {_ms(t['late_gain'])} | "
                f"{_f(t['entropy_start']['mean'])} → {_f(t['entropy_end']['mean'])} | "
                f"{_ms(t['entropy_ratio'])} | {share} |")
        lines.append("")
    return lines


def _comparison_sections(manifest: dict, registered: list, added: list, registered_at, comparisons: list,
                         late: list, k: int) -> list[str]:
    """The pre-registered comparisons' verdicts, those added after the runs started (exploratory),
    and what was added after the registration."""
    lines: list[str] = []
    if registered:
        when = (f"registered by the runner when the first run started ({registered_at} UTC; "
                f"`experiment.json`, `registration`)" if registered_at else
                "stated in the experiment file (this manifest predates the runner's registration record)")
        lines += ["## Pre-registered comparisons", "",
                  f"Stated in the experiment file before the runs, {when}: for each pair, the per-seed difference of the "
                  f"final held-out Avg@{k} (paired: same seed, same warm start), its mean, standard error and 95% "
                  f"interval (Student's t, n - 1 df); **a > b** / **a < b** when the mean exceeds twice its "
                  f"standard error in that direction, else **unresolved**; *seeds to resolve* = (2 sd / |mean|)^2 "
                  f"(`hapo_openrlhf/experiment/verdicts.py`).", ""]
        alpha = familywise_alpha(manifest)
        lines += [f"Multiplicity: *p* is the two-sided p-value of the paired t statistic (n - 1 df); **Holm** is "
                  f"Holm's step-down verdict over these {len(comparisons)} pre-registered comparisons at the "
                  f"family-wise level {alpha:g} the experiment file names (`familywise_alpha`): sorted by p, the "
                  f"i-th smallest (from 0) is resolved while p <= {alpha:g} / (m - i), and the first that is not "
                  f"stops it. A comparison resolved at 2 s.e. but not by Holm does not survive the correction.", ""]
        lines += verdict_table(comparisons, k, alpha) + [""]
    if late:
        lines += ["## Comparisons added after the runs started", "",
                  "Not pre-registered: each was first stated after the runs had started (" +
                  "; ".join(f"{c['a']} vs {c['b']}: {c['at']}" for c in added) + "). Same statistics as above; "
                  "read them as exploratory.", ""]
        lines += verdict_table(late, k) + [""]
    late_seeds, late_variants = manifest.get("seeds_added") or {}, manifest.get("variants_added") or {}
    planned = {str(x) for x in (manifest.get("registration") or {}).get("planned_seeds") or []}
    later = {s: t for s, t in late_seeds.items() if s in planned}
    late_seeds = {s: t for s, t in late_seeds.items() if s not in planned}
    if registered_at and later:
        lines += [f"Run after the registration, as the experiment file named them when it was registered: "
                  f"{len(later)} seed(s) ({_seed_span(later)}).", ""]
    if registered_at and (late_seeds or late_variants):
        seeds = ([f"{len(late_seeds)} seeds ({_seed_span(late_seeds)})"] if len(late_seeds) > 6 else
                 [f"seed {s} ({t})" for s, t in late_seeds.items()])
        lines += ["Added after the registration: " + "; ".join(
            seeds + [f"variant {v} ({t})" for v, t in late_variants.items()]) + ".", ""]
    return lines


def export_results(exp_dir: str | Path, path: str | Path | None = None) -> Path:
    """Write the experiment's results file (experiment/results.py): ``path``, else ``EXP_DIR/results.json``."""
    from .registration import fingerprint
    from .results import export, write

    exp_dir = Path(exp_dir)
    manifest, runs, _ = load_experiment_runs(exp_dir)
    prints = {}
    for r in runs:
        name = f"{r.variant}/seed_{r.seed}"
        cfg = Path(manifest["runs"][name]) / "config.yaml"
        if cfg.exists():
            import yaml

            prints[name] = fingerprint(yaml.safe_load(cfg.read_text()) or {})
    return write(path or exp_dir / "results.json", export(manifest, runs, prints))


def _results_runs(path: Path) -> tuple[dict, list[RunStats], list[str]]:
    """(manifest, runs, missing runs) from a results file (experiment/results.py)."""
    from .results import load

    manifest, runs = load(path)
    have = {f"{r.variant}/seed_{r.seed}" for r in runs}
    missing = sorted({f"{v}/seed_{s}" for su in suites_run(manifest) for v in manifest["suites"][su]
                      for s in manifest["seeds"]} - have)
    return manifest, runs, missing


def _warm_start_design(manifest: dict) -> str:
    """The report's sentence on where the runs started: nested warm starts, one shared, or one per seed."""
    ws, nested = manifest.get("warm_start_seed"), manifest.get("warm_start_of_seed")
    if isinstance(nested, dict):
        starts = sorted(set(nested.values()))
        return (f"the seeds are nested in {len(starts)} warm starts (trained with seeds {starts}); comparisons "
                f"average the paired differences within each warm start, then over warm starts")
    return ("every run starts from one warm start (trained with seed {}): verdicts are conditional on that "
            "model".format(ws) if ws is not None else "each seed's runs share one warm start")


def _credit_section(runs: list[RunStats], variants: list[str], out: Path, results_file: str | None) -> list[str]:
    """The token-credit table from the runs' token-credit counts (their dumped samples, or the results
    file's copy of them); a results file that keeps none says so."""
    credit = credit_table(runs, variants)
    if not credit:
        if results_file is None:
            return []
        return [f"(Built from the results file `{results_file}` alone: it keeps no run's token-credit counts -- "
                f"written before results files kept them, or by runs that dumped no token samples -- so there is "
                f"no token-credit table.)", ""]
    (out / "credit.json").write_text(json.dumps(credit, indent=1))
    return ["## Token credit: where the advantage moved", "",
            "From every run's dumped token samples (all seeds pooled): each response token is a *fork* "
            "(the first token, and the character after a step's second operand: write the intermediate "
            "result or skip it), a *result* character (after `=`, inside `\\boxed{}`) or *routine*; the "
            "credit shift is `sum | |A^h| - |A| |`, the advantage a token-level method moved away from the "
            "sequence's (`hapo_openrlhf/experiment/credit.py`). GRPO and DAPO move none.", "",
            *credit_markdown(credit), ""]


def build_experiment_report(exp_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """The report of an experiment directory, or of a results file alone (``results.json``: every
    table and figure; the token-credit table from the counts the file keeps per run)."""
    from .results import is_results_file

    exp_dir = Path(exp_dir)
    from_file = is_results_file(exp_dir)
    out = Path(out_dir or (exp_dir.parent / f"{exp_dir.stem}_report" if from_file else exp_dir / "report"))
    out.mkdir(parents=True, exist_ok=True)
    manifest, runs, missing = _results_runs(exp_dir) if from_file else load_experiment_runs(exp_dir)
    if not runs:
        raise ValueError(f"{str(exp_dir)!r}: no finished run yet")
    suites = {s: manifest["suites"][s] for s in suites_run(manifest)}
    variants = [v for vs in suites.values() for v in vs]
    table = variant_table(runs, list(dict.fromkeys(variants)))
    findings = evaluate_findings(runs)
    (out / "findings.json").write_text(json.dumps(findings, indent=1))
    registered, added, registered_at = comparison_sets(manifest)
    clusters = warm_start_of_seed(manifest)
    comparisons = holm(compare(runs, registered, clusters), familywise_alpha(manifest))  # one family: the registered
    late = compare(runs, [{"a": c["a"], "b": c["b"]} for c in added], clusters)
    for row, c in zip(late, added):
        row["added_after_runs"] = c["at"]
    if comparisons or late:
        (out / "comparisons.json").write_text(json.dumps(comparisons + late, indent=1))
    (out / "stats.json").write_text(json.dumps(table, indent=1))
    pngs = _plots(runs, suites, out)

    k = runs[0].k
    jobs = manifest.get("jobs", {})
    job_s = sum(j.get("wall_s", 0.0) for j in jobs.values())
    steps = sorted({r.steps for r in runs})
    warm = _warm_start_design(manifest)
    lines = [
        f"# Experiment report: {Path(manifest['experiment']).name}", "",
        f"Seeds {manifest['seeds']}; {len(runs)} finished runs; RL steps {steps}; "
        f"held-out Avg@{k} / Pass@{k}. Mean ± sample std over seeds; {warm}.",
        f"Wall time of the last `hapo experiment` invocation: {_f(manifest.get('wall_s_this_invocation', 0) / 60, 1)} min "
        f"({manifest['workers']} workers x {manifest['threads_per_worker']} thread(s); "
        f"{_f(job_s / 60, 1)} min of run time over all runs, including earlier invocations).", "",
    ]
    lines += _code_lines(manifest, runs)
    lines += _missing_lines(missing, len(runs))
    if manifest.get("failed"):
        lines += [f"**Failed runs**: {', '.join(manifest['failed'])} (see experiment.json)", ""]
    lines += _suite_tables(suites, table, k)
    lines += _comparison_sections(manifest, registered, added, registered_at, comparisons, late, k)
    lines += _credit_section(runs, variants, out, exp_dir.name if from_file else None)
    lines += ["## Per-quadrant entropy at the end (mean of the last 10 steps)", "",
              "| variant | " + " | ".join(QUADRANTS) + " |", "|---|" + "---|" * len(QUADRANTS)]
    for v, t in table.items():
        lines.append(f"| {v} | " + " | ".join(_ms(t[f"{q}_entropy_end"]) for q in QUADRANTS) + " |")
    lines += ["", "## The paper's findings", "",
              "Rule: a paired difference over seeds agrees when it points the paper's way by more than twice "
              "its standard error, disagrees when it points the other way by as much, and is inconclusive "
              "otherwise (see `hapo_openrlhf/experiment/findings.py`).", "",
              "| finding | verdict | evidence (mean ± s.e. of the per-seed difference) |", "|---|---|---|"]
    for f in findings:
        lines.append(f"| {f['claim']} <br>*{f['reading']}* | **{f['verdict']}** | {f['evidence']} |")
    if not findings:
        lines.append("| (no finding has all its variants in this experiment) | | |")
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs]
    lines += ["", "Definitions: *early gain* = mean Avg@k over the evaluations in the first half of RL minus the "
              "warm start's; *late gain* = mean over the second half's evaluations minus the first half's; "
              "*entropy ratio* = mean behaviour entropy of the last 10 steps / first 10 steps; *share* = mean "
              "token share of each quadrant over the run (high entropy = at or above the group's mean token entropy, as published)."]
    md = out / "experiment.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def _seed_span(seeds: dict[str, str]) -> str:
    """'721, 722, ... 892; first run from 2026-12-06T07:45:46Z': the seeds and the earliest time one was added."""
    names = sorted(seeds, key=lambda x: int(x) if x.lstrip("-").isdigit() else 0)
    shown = ", ".join(names[:6]) + (f", ... {names[-1]}" if len(names) > 6 else "")
    return f"{shown}; first run from {min(seeds.values())}"


def _missing_lines(missing: list[str], finished: int) -> list[str]:
    """The runs not finished: listed when few; counted per variant when many, under a banner that
    says every table and verdict below is of the finished runs only (a partial experiment)."""
    if not missing:
        return []
    if len(missing) <= 20:
        return [f"**Missing runs** (not finished): {', '.join(missing)}", ""]
    per: dict[str, int] = {}
    for name in missing:
        per[name.split("/")[0]] = per.get(name.split("/")[0], 0) + 1
    return [f"**Partial: {finished} of {finished + len(missing)} runs finished.** Every table and verdict below "
            f"is computed on the finished runs alone, not the experiment as registered. Missing per variant: "
            + ", ".join(f"{v} {n}" for v, n in per.items()) + f" (first: {', '.join(missing[:4])}, ...).", ""]
