"""Token-credit view: sampled responses with every token coloured by its entropy
and by its HAPO multiplier, marked by quadrant (the paper's Appendix H idea)."""

from __future__ import annotations

import html
import json
from pathlib import Path

from ..algos.quadrants import QUADRANTS
from ..rundir.jsonfile import read_small_text

MAX_SAMPLES_FILE = 256 * 2**20  # a step's dumped samples: a few MB at the paper's scale

QUAD_COLOR = {"PHR": "#1a9850", "PLR": "#91cf60", "NHR": "#d73027", "NLR": "#fc8d59", "": "#cccccc"}


def _entropy_bg(h: float, hmax: float) -> str:
    a = 0 if hmax <= 0 else min(1.0, h / hmax)
    return f"rgba(255,140,0,{a:.2f})"


def _mult_bg(m: float) -> str:
    # blue below 1 (damped), red above 1 (amplified); HAPO's default range is [0.6, 1.4]
    d = max(-1.0, min(1.0, (m - 1.0) / 0.4))
    return f"rgba(220,40,40,{d:.2f})" if d >= 0 else f"rgba(40,80,220,{-d:.2f})"


def _row(rec: dict, view: str, hmax: float) -> str:
    spans = []
    for tok, h, m, q, a in zip(rec["tokens"], rec["entropy"], rec["multiplier"], rec["quadrant"], rec["advantage"]):
        bg = _entropy_bg(h, hmax) if view == "entropy" else _mult_bg(m)
        tip = html.escape(f"H={h:.3f}  mult={m:.3f}  A={a:.3f}  {q or 'no quadrant'}", quote=True)
        text = html.escape(tok).replace("\n", "\u21b5") or "&nbsp;"
        spans.append(f'<span class="t" style="background:{bg};border-bottom:3px solid {QUAD_COLOR[q]}" '
                     f'title="{tip}">{text}</span>')
    return "".join(spans)


_NUM = (int, float)
_LISTS = {"tokens": str, "entropy": _NUM, "multiplier": _NUM, "quadrant": str, "advantage": _NUM,
          "base_advantage": _NUM}


def read_samples(samples_file: str | Path) -> list[dict]:
    """The records of a trainer's ``samples/step_*.jsonl``; a damaged line (not JSON, not an
    object, a missing or mistyped field, per-token lists of different lengths) is an error
    naming file and line."""
    recs = []
    for i, line in enumerate(read_small_text(samples_file, "token samples", MAX_SAMPLES_FILE).splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            if not isinstance(r, dict):
                raise ValueError(f"a JSON {type(r).__name__}, not an object")
            for k, tp in _LISTS.items():
                v = r.get(k)
                if not isinstance(v, list) or not all(isinstance(x, tp) and not isinstance(x, bool) for x in v):
                    raise ValueError(f"{k!r} must be a list of {'numbers' if tp is _NUM else 'strings'}")
            unknown = sorted({q for q in r["quadrant"] if q not in QUAD_COLOR})
            if unknown:
                raise ValueError(f"unknown quadrant label(s) {unknown[:3]}; expected {QUADRANTS} or '' (none)")
            if len({len(r[k]) for k in _LISTS if k != "base_advantage"}) != 1:
                raise ValueError("the per-token lists have different lengths")
            if not isinstance(r.get("reward"), _NUM) or not isinstance(r.get("row"), int):
                raise ValueError("'reward' must be a number and 'row' an integer")
        except ValueError as e:
            raise ValueError(f"{samples_file}:{i}: corrupt sample record ({e})") from None
        recs.append(r)
    return recs


def render_token_credit(samples_file: str | Path, out_file: str | Path) -> Path:
    recs = read_samples(samples_file)
    if not recs:
        raise ValueError(f"{samples_file} holds no samples")
    hmax = max((h for r in recs for h in r["entropy"]), default=1.0)
    legend = " ".join(f'<span style="border-bottom:3px solid {c}">{q}</span>' for q, c in QUAD_COLOR.items() if q)
    parts = [
        "<!doctype html><meta charset='utf-8'><title>token credit</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:auto}"
        ".t{font-family:monospace;white-space:pre;padding:1px 0}.r{margin:6px 0;line-height:1.9}"
        "h3{margin-bottom:2px}</style>",
        f"<h1>Token credit: {html.escape(Path(samples_file).stem)}</h1>",
        "<p>Top line of each response: background = behaviour entropy (orange = high). "
        "Bottom line: background = HAPO multiplier on |A| (red &gt; 1 amplified, blue &lt; 1 damped). "
        f"Underline = quadrant: {legend}. Hover a token for its values.</p>",
    ]
    for polarity, title in ((1, "positive responses (A &gt; 0)"), (-1, "negative responses (A &lt; 0)"), (0, "zero advantage")):
        group = [r for r in recs if (r["base_advantage"][0] if r["base_advantage"] else 0) * polarity > 0
                 or (polarity == 0 and not any(r["base_advantage"]))]
        if not group:
            continue
        parts.append(f"<h2>{title}</h2>")
        for r in group:
            share = {q: sum(x == q for x in r["quadrant"]) for q in QUADRANTS}
            parts.append(f"<h3>row {r['row']} &middot; reward {r['reward']:.2f} &middot; "
                         + ", ".join(f"{q} {n}" for q, n in share.items()) + "</h3>")
            parts.append(f'<div class="r">{_row(r, "entropy", hmax)}<br>{_row(r, "multiplier", hmax)}</div>')
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(parts))
    return out
