"""Load math problems from JSONL / JSON / Parquet files, the bundled files or a
Hugging Face dataset, mapping the field names the public sets use.

Rows without a usable answer are dropped and counted (logged); a row that is not
valid JSON is an error naming the file and line, unless ``on_bad_row="skip"``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..rewards.extract import last_boxed
from ..rewards.verify import answer_strings

log = logging.getLogger(__name__)

BUNDLED_DIR = Path(__file__).parent / "bundled"
BUNDLED = {
    **{p.stem: p for p in sorted((BUNDLED_DIR / "benchmarks").glob("*.jsonl"))},
    **{p.stem: p for p in sorted((BUNDLED_DIR / "train").glob("*.jsonl"))},
}
PROBLEM_FIELDS = ("problem", "question", "prompt", "query", "input")
ANSWER_FIELDS = ("answer", "final_answer", "ground_truth", "gt_answer", "solution")


@dataclass(frozen=True)
class Problem:
    problem: str
    answer: tuple[str, ...]  # accepted reference answers
    id: str = ""
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


@dataclass
class LoadReport:
    source: str
    rows: int = 0
    kept: int = 0
    dropped_no_problem: int = 0
    dropped_no_answer: int = 0
    skipped_malformed: int = 0

    def __str__(self) -> str:
        return (
            f"{self.source}: {self.kept}/{self.rows} rows kept (no problem: {self.dropped_no_problem}, "
            f"no usable answer: {self.dropped_no_answer}, malformed: {self.skipped_malformed})"
        )


def _pick(row: dict, wanted: str | None, candidates: tuple[str, ...]):
    if wanted:
        return row.get(wanted), wanted
    for k in candidates:
        if row.get(k) not in (None, "", []):
            return row[k], k
    return None, None


def row_to_problem(
    row: dict, idx: int, source: str, problem_field: str | None = None, answer_field: str | None = None
) -> Problem | None:
    """Map one raw row; None without problem text, an empty ``answer`` without a usable answer."""
    prob, _ = _pick(row, problem_field, PROBLEM_FIELDS)
    if not isinstance(prob, str) or not prob.strip():
        return None
    ans, key = _pick(row, answer_field, ANSWER_FIELDS)
    if key == "solution" or (isinstance(ans, list) and ans and all(isinstance(a, str) and "\\boxed" in a for a in ans)):
        sols = ans if isinstance(ans, list) else [ans]
        ans = [b for b in (last_boxed(str(s)) for s in sols) if b]
    if isinstance(ans, (bool, dict)) or ans is None:
        return Problem(prob, (), "", source)  # empty answer: counted as dropped
    golds = tuple(answer_strings(ans))
    if not golds:
        return Problem(prob, (), "", source)
    pid = str(row.get("id", row.get("unique_id", row.get("idx", idx))))
    meta = {k: v for k, v in row.items() if k in ("difficulty", "type", "level", "subject", "year")}
    return Problem(prob.strip(), golds, pid, source, meta)


# how a bad row can be dropped, for the error: a training run's key (hapo eval has none)
TRAIN_SKIP_HINT = "fix it or set data.on_bad_row: skip"
EVAL_SKIP_HINT = "fix it (a benchmark is scored on every problem, so hapo eval skips no row)"


def _iter_rows(path: Path, on_bad_row: str, report: LoadReport,
               hint: str = TRAIN_SKIP_HINT) -> Iterator[tuple[int, dict]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open("rb") as f:  # decoded line by line: one bad line is that line's error (or skip)
            for ln, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    line = raw.decode("utf-8")
                    row = json.loads(line)
                    if not isinstance(row, dict):
                        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
                except ValueError as e:
                    if on_bad_row == "skip":
                        report.skipped_malformed += 1
                        continue
                    raise ValueError(f"{path}:{ln}: malformed row ({e}); {hint}") from e
                yield ln, row
    elif suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:  # UnicodeDecodeError is a ValueError too
            raise ValueError(f"{path}: not a readable JSON file ({str(e)[:200]}); "
                             + (hint if hint == EVAL_SKIP_HINT else
                                "fix it, or use .jsonl with data.on_bad_row: skip to drop bad rows")) from None
        rows = data.get("data", data) if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of objects (or {{'data': [...]}})")
        for i, row in enumerate(rows, 1):
            if not isinstance(row, dict):  # like a .jsonl row: an object, or a named error / counted skip
                if on_bad_row == "skip":
                    report.skipped_malformed += 1
                    continue
                raise ValueError(f"{path}: item {i} is a JSON {type(row).__name__}, not an object with "
                                 f"problem/answer fields; {hint}")
            yield i, row
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading Parquet needs pyarrow: pip install 'hapo-openrlhf[data]'") from None

        yield from enumerate(pq.read_table(path).to_pylist(), 1)
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r} (use .jsonl, .json or .parquet)")


def _iter_hf(name: str, split: str) -> Iterator[tuple[int, dict]]:
    """A hub id, a local dataset repo (data files) or a ``save_to_disk`` directory."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"hf:{name} needs the datasets package: pip install 'hapo-openrlhf[data]'") from None

    if (Path(name) / "dataset_info.json").exists() or (Path(name) / "dataset_dict.json").exists():
        ds = datasets.load_from_disk(name)
        ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
    else:
        ds = datasets.load_dataset(name, split=split)
    yield from enumerate(ds, 1)


def load_problems(
    source: str,
    *,
    problem_field: str | None = None,
    answer_field: str | None = None,
    split: str = "train",
    limit: int | None = None,
    on_bad_row: str = "error",
    skip_hint: str = TRAIN_SKIP_HINT,
) -> tuple[list[Problem], LoadReport]:
    """Problems from ``source``: a bundled name (``aime24``, ``math_train`` ...), a file
    path, or ``hf:<dataset id>``. Returns (problems, report); raises on an empty result."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
    report = LoadReport(source)
    if source in BUNDLED:
        rows = _iter_rows(BUNDLED[source], on_bad_row, report, skip_hint)
    elif source.startswith("hf:"):
        rows = _iter_hf(source[3:], split)
    else:
        path = Path(source)
        if not path.exists():
            raise ValueError(f"dataset {source!r} not found: not a bundled name {sorted(BUNDLED)} nor a file")
        rows = _iter_rows(path, on_bad_row, report, skip_hint)
    out: list[Problem] = []
    for idx, row in rows:
        report.rows += 1
        p = row_to_problem(row, idx, source, problem_field, answer_field)
        if p is None:
            report.dropped_no_problem += 1
        elif not p.answer:
            report.dropped_no_answer += 1
        else:
            out.append(p)
        if limit is not None and len(out) >= limit:
            break
    report.kept = len(out)
    if report.dropped_no_answer or report.dropped_no_problem or report.skipped_malformed:
        log.warning("%s", report)
    if not out:
        raise ValueError(f"dataset {source!r} yielded no usable problems ({report})")
    return out, report
