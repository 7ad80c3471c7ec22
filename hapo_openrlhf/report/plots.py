"""PNG plots of a run's metrics.jsonl: reward, entropy, quadrant shares."""

from __future__ import annotations

from pathlib import Path

from ..algos.quadrants import QUADRANTS
from ..local.logger import read_metrics

PANELS = {
    "reward": (["reward/mean", "reward/accuracy"], "training reward"),
    "entropy": (["actor/entropy"] + [f"quadrant/{q}/entropy_mean" for q in QUADRANTS], "token entropy (behaviour policy)"),
    "quadrants": ([f"quadrant/{q}/token_frac" for q in QUADRANTS], "token share per quadrant"),
}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write reward.png, entropy.png, quadrants.png for ``run_dir``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    out_dir = Path(out_dir or run_dir / "plots")
    out_dir.mkdir(parents=True, exist_ok=True)
    recs = [r for r in read_metrics(run_dir) if "reward/mean" in r]
    if not recs:
        raise ValueError(f"{str(run_dir)!r} has no training steps in metrics.jsonl yet")
    written = []
    for name, (keys, title) in PANELS.items():
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for k in keys:
            pts = [(r["step"], r[k]) for r in recs if r.get(k) is not None]
            if pts:
                line, = ax.plot(*zip(*pts), alpha=0.35, lw=0.8)
                xs, ys = zip(*pts)
                w = max(1, len(ys) // 10)  # a moving average makes the trend readable
                smooth = [sum(ys[max(0, i - w + 1) : i + 1]) / len(ys[max(0, i - w + 1) : i + 1]) for i in range(len(ys))]
                ax.plot(xs, smooth, color=line.get_color(), lw=1.8, label=f"{k.removeprefix('quadrant/')} (avg {w})")
        ax.set_xlabel("RL step")
        ax.set_title(f"{title} — {run_dir.name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out_dir / f"{name}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written
