"""Metrics sink for the embedded trainer: JSONL (source of truth) + TensorBoard."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path


log = logging.getLogger(__name__)


def read_jsonl_records(path: Path) -> list[dict]:
    """The records of a JSONL log. A torn *last* line (a crash or a full disk mid-write) is
    dropped with a warning; a corrupt line before the end -- not JSON, not an object, or a
    ``step`` that is not a non-negative integer -- is an error naming file and line. A
    non-finite metric, written as ``"nan"`` / ``"inf"`` / ``"-inf"`` (JSON has no literal for
    it; :func:`metric_value`), is read back as that float. The read is bounded as every other
    file the project reads (``jsonfile.read_small_bytes``): a regular file of at most
    :data:`MAX_METRICS_BYTES` (a FIFO would block, ``/dev/zero`` would fill memory)."""
    from .jsonfile import read_small_bytes

    lines = read_small_bytes(path, "a run's metrics log", MAX_METRICS_BYTES).decode("utf-8", "replace").splitlines()
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    out = []
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
            if not isinstance(rec, dict):
                raise ValueError(f"a JSON {type(rec).__name__}, not an object")
            step = rec.get("step", 0)
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"'step' must be an integer >= 0, got {step!r}")
        except ValueError as e:
            if i == last:
                log.warning("%s:%d: dropping a torn last line (%s)", path, i + 1, e)
                continue
            raise ValueError(f"{path}:{i + 1}: corrupt line ({e}); repair or remove it") from None
        out.append({k: float(v) if isinstance(v, str) and v in NONFINITE else v for k, v in rec.items()})
    return out


NONFINITE = ("nan", "inf", "-inf")
# a 900-step paper run logs ~2 MB; a league's longest run far less
MAX_METRICS_BYTES = 512 * 2**20


def metric_value(v):
    """A metric for ``metrics.jsonl``: JSON has no NaN or infinity, so a non-finite float is
    written as the string ``"nan"`` / ``"inf"`` / ``"-inf"`` (``float()`` reads it back)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def record_line(rec: dict) -> str:
    """One JSONL line; a non-finite float is written as ``"nan"`` / ``"inf"`` / ``"-inf"``
    (:func:`metric_value`), which :func:`read_jsonl_records` reads back."""
    return json.dumps({k: metric_value(v) for k, v in rec.items()}) + "\n"


class MetricsLogger:
    def __init__(self, out_dir: Path, resume_step: int | None):
        self.path = out_dir / "metrics.jsonl"
        out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:
            self._truncate_after(resume_step)
        self._tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=(resume_step or 0) + 1)
        except ImportError:  # tensorboard is a base dependency; keep logging if it is missing
            pass

    def _truncate_after(self, step: int) -> None:
        """Drop records of steps after the checkpoint, so a resumed run's file equals an
        uninterrupted run's (the killed run may have logged steps it never saved)."""
        if not self.path.exists():
            return
        keep = [r for r in read_jsonl_records(self.path) if r.get("step", 0) <= step]
        self.path.write_text("".join(record_line(r) for r in keep))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(record_line({"step": step, **metrics}))  # a NaN is logged, as "nan"
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        raise ValueError(f"{str(p)!r} not found: is {str(run_dir)!r} a run directory?")
    return read_jsonl_records(p)
