"""`hapo report`: plots + token-credit pages + one index.html.

Every value from a run directory (its name, a samples file's name, a metric) is escaped
before it reaches the page: text with ``html.escape``, paths in ``href``/``src`` percent-
encoded and then escaped (``_href``); tests parse the page to check that nothing from a
name becomes an element or an attribute."""

from __future__ import annotations

import html
from pathlib import Path
from urllib.parse import quote

from ..rundir.jsonfile import read_json_object
from .plots import plot_runs
from .token_credit import render_token_credit


def _href(rel) -> str:
    """A relative file path as an attribute value: percent-encoded as a URL path (so a run
    named ``a"><img ...`` or ``javascript:x`` stays one relative path), then HTML-escaped."""
    return html.escape(quote(Path(rel).as_posix(), safe="/"), quote=True)


def _number(where: Path, key: str, value) -> float:
    """A metric the report prints: a number (JSON's, or the "nan" / "inf" a run log writes for a
    non-finite one); anything else is an error naming the file and key."""
    from ..rundir.logger import NONFINITE

    if isinstance(value, str) and value in NONFINITE:
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def build_report(run_dirs: list[str | Path], out_dir: str | Path) -> Path:
    out = Path(out_dir)
    pngs = plot_runs(run_dirs, out)
    rows, credit_links = [], []
    for d in map(Path, run_dirs):
        summary = d / "summary.json"
        if summary.exists():
            s = read_json_object(summary, "the run's summary")
            b, a = s.get("before"), s.get("after")
            if not (isinstance(b, dict) and isinstance(a, dict)):
                raise ValueError(f"{summary}: 'before' and 'after' must be JSON objects of metrics")
            vals = {f"{side}.{k}": _number(summary, f"{side}.{k}", part.get(k, default))
                    for side, part in (("before", b), ("after", a))
                    for k, default in (("eval/accuracy", float("nan")), ("eval/response_len", 0))}
            rows.append(f"<tr><td>{html.escape(d.name)}</td><td>{vals['before.eval/accuracy']:.3f}</td>"
                        f"<td>{vals['after.eval/accuracy']:.3f}</td>"
                        f"<td>{vals['before.eval/response_len']:.1f}</td>"
                        f"<td>{vals['after.eval/response_len']:.1f}</td></tr>")
        samples = sorted((d / "samples").glob("step_*.jsonl"))
        for f in samples[:1] + samples[-1:] if len(samples) > 1 else samples:
            page = render_token_credit(f, out / "token_credit" / f"{d.name}_{f.stem}.html")
            credit_links.append(f'<li><a href="{_href(page.relative_to(out))}">{html.escape(d.name)} '
                                f'{html.escape(f.stem)}</a></li>')
    parts = [
        "<!doctype html><meta charset='utf-8'><title>hapo report</title>"
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}img{max-width:100%}"
        "td,th{padding:2px 10px}</style>",
        "<h1>hapo report</h1><p>runs: " + ", ".join(html.escape(str(d)) for d in run_dirs) + "</p>",
    ]
    if rows:
        parts.append("<h2>held-out evaluation</h2><table><tr><th>run</th><th>accuracy before</th>"
                     "<th>accuracy after</th><th>tokens before</th><th>tokens after</th></tr>" + "".join(rows) + "</table>")
    if credit_links:
        parts.append("<h2>token credit</h2><ul>" + "".join(credit_links) + "</ul>")
    parts += [f'<h2>{html.escape(p.stem)}</h2><img src="{_href(p.name)}">' for p in pngs]
    index = out / "index.html"
    index.write_text("\n".join(parts))
    return index
