"""PNG plots from one or more runs' metrics.jsonl, runs overlaid (the paper's
Figure 2 / 6 views: reward, entropy, clip fraction, per-quadrant token share,
entropy and |A| over steps; Figure 3: accuracy vs response tokens), and each competitor
method's own metrics (``method_eapo.png``, ...) for the runs that log them."""

from __future__ import annotations

import math
from pathlib import Path

from ..algos.quadrants import QUADRANTS
from ..rundir.logger import read_metrics

SINGLE = {
    "reward": (["reward/accuracy"], "training accuracy (rollouts)"),
    "entropy": (["actor/entropy"], "mean token entropy (behaviour policy)"),
    "clip_frac": (["actor/clip_frac"], "PPO clip fraction"),
    "response_len": (["response/length_mean"], "response length (tokens)"),
}
PER_QUADRANT = {
    "quadrant_share": ("token_frac", "token share"),
    "quadrant_entropy": ("entropy_mean", "mean entropy"),
    "quadrant_adv": ("adv_abs_mean", "mean |A|"),
    "quadrant_entropy_delta": ("entropy_delta", "entropy change per update"),
}

# each competitor's own metrics (docs/method.md 5b), one figure per method whose runs log them
METHOD_METRICS = {"eapo": "EAPO-entropic", "pepo": "PEPO", "less": "LESS", "stare": "STARE", "rsi": "RSI-S",
                  "paec": "PAEC", "prime": "PRIME (its rewards)", "prm": "PRIME's implicit PRM",
                  "filter": "the group-accuracy filter"}


def moving_average(ys: list[float], w: int) -> list[float]:
    """Trailing mean over the last ``w`` points (fewer at the start)."""
    return [sum(ys[max(0, i - w + 1) : i + 1]) / len(ys[max(0, i - w + 1) : i + 1]) for i in range(len(ys))]


def save_png(fig, out_dir: Path, name: str, written: list[Path], dpi: int = 110) -> None:
    """Lay out, write ``out_dir/name.png``, close the figure and record its path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    p = out_dir / f"{name}.png"
    fig.savefig(p, dpi=dpi)
    plt.close(fig)
    written.append(p)


def _smooth(ys: list[float]) -> tuple[list[float], int]:
    w = max(1, len(ys) // 10)
    return moving_average(ys, w), w


def _series(recs, key):
    pts = [(r["step"], r[key]) for r in recs
           if r.get(key) is not None and "reward/mean" in r
           and not (isinstance(r[key], float) and not math.isfinite(r[key]))]
    return zip(*pts) if pts else ((), ())


def _draw(ax, runs, key, label_suffix=""):
    for name, recs in runs:
        xs, ys = _series(recs, key)
        if not xs:
            continue
        (line,) = ax.plot(xs, ys, alpha=0.3, lw=0.8)
        sm, w = _smooth(list(ys))
        ax.plot(xs, sm, color=line.get_color(), lw=1.8, label=f"{name}{label_suffix}")
    ax.grid(alpha=0.3)


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Write the PNGs for ``run_dirs`` into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(d).name, read_metrics(d)) for d in run_dirs]
    if not any("reward/mean" in r for _, recs in runs for r in recs):
        raise ValueError(f"no training steps in {[str(d) for d in run_dirs]} (metrics.jsonl)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        save_png(fig, out_dir, name, written)

    for name, (keys, title) in SINGLE.items():
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for k in keys:
            _draw(ax, runs, k)
        ax.set(title=f"{title} (moving average)", xlabel="RL step")
        ax.legend(fontsize=7)
        save(fig, name)
    for name, (stat, title) in PER_QUADRANT.items():
        fig, axes = plt.subplots(2, 2, figsize=(9, 6), sharex=True)
        for ax, q in zip(axes.flat, QUADRANTS):
            _draw(ax, runs, f"quadrant/{q}/{stat}")
            ax.set_title(f"{q}: {title}", fontsize=9)
        axes[1, 0].set_xlabel("RL step")
        axes[0, 0].legend(fontsize=7)
        save(fig, name)
    for prefix, method in METHOD_METRICS.items():
        keys = sorted({k for _, recs in runs for r in recs for k in r if k.startswith(prefix + "/")})
        if not keys:
            continue
        cols = min(3, len(keys))
        rows = -(-len(keys) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
        for ax, k in zip(axes.flat, keys):
            _draw(ax, runs, k)
            ax.set_title(k, fontsize=9)
        for ax in list(axes.flat)[len(keys):]:
            ax.axis("off")
        axes[0, 0].legend(fontsize=7)
        fig.suptitle(f"{method}: its own metrics (moving average)", fontsize=10)
        save(fig, f"method_{prefix}")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, recs in runs:
        pts = [(_eval_number(name, r, "eval/response_len"), _eval_number(name, r, "eval/accuracy"))
               for r in recs if "eval/accuracy" in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
            ax.annotate("start", pts[0], fontsize=7)
    ax.set(title="held-out accuracy vs response tokens", xlabel="mean response tokens", ylabel="Avg@k")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, "accuracy_vs_tokens")
    return written



def _eval_number(run: str, rec: dict, key: str) -> float:
    """An evaluation record's metric as the accuracy plot needs it; a missing or non-numeric one is
    an error naming the run's metrics log, the step and the key."""
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{run}/metrics.jsonl, the evaluation record of step {rec.get('step')}: {key} must be a "
                         f"number, got {v!r}" + (" (missing)" if key not in rec else ""))
    return float(v)
