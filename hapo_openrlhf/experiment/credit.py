"""Where token-level credit lands: the hindsight-capacity readout of an experiment's runs.

For each run, the token samples the embedded trainer dumps (``samples/step_*.jsonl``:
per response token its text, the estimator's advantage ``A^h`` and the sequence-level
base advantage ``A``) are split into three classes by the arithmetic tasks' text:

* **fork**: the character right after a step's second operand (``47+38`` then ``=``:
  write the intermediate result, or ``-``: skip it, two operations in one step) and the
  first character of a response (work it out or state an answer) -- the decisions;
* **result**: the characters of a stated result (after ``=`` up to ``.``, and inside
  ``\\boxed{}``) -- where a wrong decision shows;
* **routine**: everything else (copying operands, separators, ``\\boxed{``).

Per class: its share of the tokens, and its share of the *credit shift* mass
``sum | |A^h| - |A| |`` (the part of the advantage a token-level method moved away from
the sequence's), with the mean ``|A^h| / |A|``. A method that puts its credit where the
decisions are has a fork share of the shift well above the forks' share of tokens. GRPO
and DAPO move nothing (shift 0).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

CLASSES = ("fork", "result", "routine")
_STEP_LHS = re.compile(r"-?\d+[+\-*]\d+$")  # a step so far: first operand, op, second operand


def token_classes(tokens: list[str]) -> list[str]:
    """The class of each response token (one character each for the tiny tokenizer; a
    longer token takes the class of its first character)."""
    out: list[str] = []
    text = ""
    step = ""  # the current step's text since the last ". " (or the response start)
    in_result = in_box = False
    for i, tok in enumerate(tokens):
        c = tok[:1]
        if i == 0:
            cls = "fork"
        elif in_box:
            cls = "result" if c not in "}" else "routine"
        elif in_result:
            cls = "result" if c not in ". " else "routine"
        elif _STEP_LHS.search(step) and c in "=+-*":
            cls = "fork"
        else:
            cls = "routine"
        out.append(cls)
        text += tok
        step += tok
        if c == "=":
            in_result = True
        elif c == "." and in_result:
            in_result, step = False, ""
        if text.endswith("\\boxed{"):
            in_box, in_result = True, False
        elif in_box and c == "}":
            in_box = False
        if c == " " and not in_result:
            step = ""
    return out


def credit_counts(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per class, what the table is built from, additive over runs: ``tokens`` (count), ``shift``
    (sum of ``| |A^h| - |A| |``), ``scale_sum`` and ``scale_n`` (sum and count of ``|A^h| / |A|``
    where ``A != 0``). A run's counts are what its results-file row keeps (issue 60)."""
    out = {c: {"tokens": 0, "shift": 0.0, "scale_sum": 0.0, "scale_n": 0} for c in CLASSES}
    for r in rows:
        for cls, a, b in zip(token_classes(r["tokens"]), r["advantage"], r["base_advantage"]):
            o = out[cls]
            o["tokens"] += 1
            o["shift"] += abs(abs(a) - abs(b))
            if b:
                o["scale_sum"] += abs(a) / abs(b)
                o["scale_n"] += 1
    return out


def credit_from_counts(counts: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per class: token share, share of the credit-shift mass, mean |A^h|/|A| (where A != 0), of
    several runs' :func:`credit_counts` pooled (summed in the order given)."""
    tot = {c: {k: sum(x[c][k] for x in counts) for k in ("tokens", "shift", "scale_sum", "scale_n")}
           for c in CLASSES}
    tot_n, tot_s = sum(t["tokens"] for t in tot.values()), sum(t["shift"] for t in tot.values())
    return {c: {"token_share": t["tokens"] / tot_n if tot_n else math.nan,
                "shift_share": t["shift"] / tot_s if tot_s > 0 else math.nan,
                "mean_scale": t["scale_sum"] / t["scale_n"] if t["scale_n"] else math.nan,
                "tokens": t["tokens"]} for c, t in tot.items()}


def credit_by_class(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per class: token share, share of the credit-shift mass, mean |A^h|/|A| (where A != 0)."""
    return credit_from_counts([credit_counts(rows)])


def check_counts(x: Any, where: str) -> dict[str, dict[str, float]]:
    """A results file's per-run credit counts, every field checked by name (a damaged file is an error)."""
    if not isinstance(x, dict) or set(x) != set(CLASSES):
        raise ValueError(f"{where}: credit must map each of {', '.join(CLASSES)} to its counts")
    out = {}
    for c in CLASSES:
        v = x[c]
        if not isinstance(v, dict) or set(v) != {"tokens", "shift", "scale_sum", "scale_n"}:
            raise ValueError(f"{where}: credit[{c!r}] must hold tokens, shift, scale_sum and scale_n")
        for k in ("tokens", "scale_n"):
            if isinstance(v[k], bool) or not isinstance(v[k], int) or v[k] < 0:
                raise ValueError(f"{where}: credit[{c!r}][{k!r}] must be a count, got {v[k]!r:.40}")
        for k in ("shift", "scale_sum"):
            if isinstance(v[k], bool) or not isinstance(v[k], (int, float)) or not v[k] >= 0 or math.isinf(v[k]):
                raise ValueError(f"{where}: credit[{c!r}][{k!r}] must be a finite number >= 0, got {v[k]!r:.40}")
        out[c] = {"tokens": v["tokens"], "shift": float(v["shift"]), "scale_sum": float(v["scale_sum"]),
                  "scale_n": v["scale_n"]}
    return out


def run_samples(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every dumped token sample of a run (all steps), skipping unreadable lines by name."""
    rows = []
    for f in sorted(Path(run_dir, "samples").glob("step_*.jsonl")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{f}:{i}: not a JSON token sample ({e})") from None
            if not (isinstance(r, dict) and all(isinstance(r.get(k), list) for k in ("tokens", "advantage",
                                                                                     "base_advantage"))):
                raise ValueError(f"{f}:{i}: a token sample needs lists 'tokens', 'advantage', 'base_advantage'")
            rows.append(r)
    return rows


def markdown(table: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """The report's table: variant -> class -> figures."""
    def f(x: float) -> str:
        return "n/a" if math.isnan(x) else f"{x:.3f}"

    lines = ["| variant | tokens sampled | token share fork / result / routine | credit-shift share fork / result / "
             "routine | mean abs(A^h)/abs(A) fork / result / routine |", "|---|---|---|---|---|"]
    for v, t in table.items():
        lines.append(f"| {v} | {sum(t[c]['tokens'] for c in CLASSES)} | "
                     + " / ".join(f(t[c]["token_share"]) for c in CLASSES) + " | "
                     + " / ".join(f(t[c]["shift_share"]) for c in CLASSES) + " | "
                     + " / ".join(f(t[c]["mean_scale"]) for c in CLASSES) + " |")
    return lines
