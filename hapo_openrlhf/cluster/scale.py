"""``hapo scale``: the same run at several node counts, and its throughput table + plot.

Each node count trains into ``BASE/nodes<N>`` (its own checkpoints, metrics and Slurm
log); ``BASE/scale.json`` records the job ids. ``hapo scale --collect BASE`` reads each
run's ``metrics.jsonl``: step time (``time/step_s`` local, ``timing/step_total`` OpenRLHF)
and generated tokens per step (``response/tokens`` local, mean length x samples for
OpenRLHF), skipping the first step (start-up, compilation, caches), and writes
``BASE/scale.md`` and ``BASE/scale.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

from .sbatch import SubmitOptions, render, submit


def parse_nodes(spec: str) -> list[int]:
    try:
        nodes = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--nodes must be a comma-separated list of integers, got {spec!r}") from None
    if not nodes or min(nodes) < 1 or len(set(nodes)) != len(nodes):
        raise ValueError(f"--nodes needs distinct positive node counts, got {spec!r}")
    return nodes


def submit_scaling(config: str, nodes: list[int], opts: SubmitOptions, base: Path, dry_run: bool = False) -> dict:
    from dataclasses import replace

    base.mkdir(parents=True, exist_ok=True)
    jobs = {}
    for n in nodes:
        o = replace(opts, nodes=n, output_dir=str(base / f"nodes{n}"))
        script = render(config, o)
        if dry_run:
            print(f"# ---- nodes={n}\n{script}")
            continue
        jobs[str(n)] = {"job_id": submit(script, o.output_dir), "output_dir": o.output_dir}
    if not dry_run:
        (base / "scale.json").write_text(json.dumps({"config": str(config), "jobs": jobs}, indent=2))
    return jobs


def _throughput(metrics_path: Path) -> dict[str, float] | None:
    if not metrics_path.exists():
        return None
    from ..rundir.logger import read_jsonl_records

    rows = read_jsonl_records(metrics_path)
    steps = []
    for r in rows:
        if "time/step_s" in r and "response/tokens" in r:
            steps.append((r["time/step_s"], r["response/tokens"]))
        elif "timing/step_total" in r and "rollout/num_samples" in r:
            steps.append((r["timing/step_total"], r["rollout/response_length_mean"] * r["rollout/num_samples"]))
    steps = steps[1:] if len(steps) > 1 else steps
    if not steps:
        return None
    t = mean(s for s, _ in steps)
    tok = mean(k for _, k in steps)
    return {"steps": len(steps), "step_time_s": t, "tokens_per_step": tok, "tokens_per_s": tok / t if t > 0 else 0.0}


def collect(base: Path) -> list[dict]:
    base = Path(base)
    runs = sorted((p for p in base.glob("nodes*") if p.is_dir()), key=lambda p: int(p.name[5:]))
    if not runs:
        raise ValueError(f"{base} has no nodes<N>/ run directories (was `hapo scale` submitted there?)")
    table = []
    for p in runs:
        tp = _throughput(p / "metrics.jsonl")
        table.append({"nodes": int(p.name[5:]), **(tp or {"steps": 0})})
    ok = [r for r in table if r["steps"]]
    if ok:
        ref = ok[0]
        for r in ok:
            r["speedup"] = r["tokens_per_s"] / ref["tokens_per_s"] if ref["tokens_per_s"] else 0.0
            r["efficiency"] = r["speedup"] / (r["nodes"] / ref["nodes"])
    lines = ["| nodes | steps | step time (s) | tokens/step | tokens/s | speedup | efficiency |", "|---|---|---|---|---|---|---|"]
    for r in table:
        if not r["steps"]:
            lines.append(f"| {r['nodes']} | 0 | - | - | - | - | - |")
            continue
        lines.append(f"| {r['nodes']} | {r['steps']} | {r['step_time_s']:.3f} | {r['tokens_per_step']:.0f} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {r['efficiency']:.2f} |")
    (base / "scale.md").write_text("\n".join(lines) + "\n")
    (base / "scale_table.json").write_text(json.dumps(table, indent=2))
    if ok:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
        xs = [r["nodes"] for r in ok]
        ax[0].plot(xs, [r["tokens_per_s"] for r in ok], "o-", label="measured")
        ax[0].plot(xs, [ok[0]["tokens_per_s"] * x / xs[0] for x in xs], "--", label="linear")
        ax[0].set(xlabel="nodes", ylabel="tokens/s", title="throughput")
        ax[0].legend()
        ax[1].plot(xs, [r["step_time_s"] for r in ok], "o-")
        ax[1].set(xlabel="nodes", ylabel="s", title="step time")
        fig.tight_layout()
        fig.savefig(base / "scale.png", dpi=100)
        plt.close(fig)
    return table
