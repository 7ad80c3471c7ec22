"""Loss-head peak extra memory and time against sequence length, and the plot.

Runs ``benchmarks/loss_head.py`` (each method in its own process) for every method
at the short lengths, and only the fused paths at the long ones (the naive path
needs ~12 GB at 4k and does not fit 24 GB at 8k). Writes the figures as JSON and a
memory-vs-T plot; prints, as its last line, one JSON object with the figures and
the linear fit (MB per 1k tokens) of each fused path's memory.

    python benchmarks/loss_head_scaling.py [--short 1024,2048,4096] [--long 8192,16384,24576] \\
        [--out docs/img/loss_head_memory.png]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(tokens: int, methods: str, extra: list[str]) -> dict:
    cmd = [sys.executable, str(HERE / "loss_head.py"), "--tokens", str(tokens), "--methods", methods, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines()[:-1]:
        print(line, flush=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--short", default="1024,2048,4096")
    ap.add_argument("--long", default="8192,16384,24576")
    ap.add_argument("--short-methods", default="naive,chunked,fused,fused_fwdgrad,verl")
    ap.add_argument("--long-methods", default="fused,fused_fwdgrad")
    ap.add_argument("--chunk", default="256")
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "img" / "loss_head_memory.png"))
    args = ap.parse_args()
    rows = []
    for t, methods in [(int(t), args.short_methods) for t in args.short.split(",") if t] + \
                      [(int(t), args.long_methods) for t in args.long.split(",") if t]:
        rows.append(run(t, methods, ["--chunk", args.chunk]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    methods = dict.fromkeys(m for ms in (args.short_methods, args.long_methods) for m in ms.split(","))
    fits = {}
    for m in methods:
        pts = [(r["tokens"], r[f"{m}_peak_extra_mb"] / 1024) for r in rows if r.get(f"{m}_peak_extra_mb") is not None]
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=m)
        if len(pts) >= 2 and m.startswith("fused"):
            n = len(xs)
            mx, my = sum(xs) / n, sum(ys) / n
            slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
            fits[f"{m}_mb_per_1k_tokens"] = slope * 1024 * 1000
            fits[f"{m}_intercept_gb"] = my - slope * mx
    ax.set_xlabel("tokens T")
    ax.set_ylabel("peak extra memory of the loss head (GB)")
    ax.set_title("LM head + log-prob + entropy, V = 151,936, H = 1536, fp32, CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(json.dumps({"rows": rows, **fits, "plot": str(out)}))


if __name__ == "__main__":
    main()
