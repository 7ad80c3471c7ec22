"""Rule-based math reward: extraction, string match, then math-verify under a hard
per-sample time limit in a worker process.

Why a worker process: math-verify's own timeout is ``signal.alarm``, which only
works on the main thread and cannot interrupt C code. A separate interpreter
(``python -m hapo_openrlhf.rewards._worker``, not multiprocessing, so the
caller's ``__main__`` is never re-imported) can always be killed, so a
pathological expression costs at most ``timeout_s`` and never hangs a trainer
or a Ray actor's thread. Plain numbers never reach it (exact rational compare).
"""

from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .extract import as_number, extract_answer, normalize

log = logging.getLogger(__name__)
Answer = str | int | float | Sequence[str | int | float]


def answer_strings(answer: Answer) -> list[str]:
    """References as strings: a list/tuple gives several accepted answers; floats that
    are integral print as ints (AMC's 142.0 -> "142")."""
    items = list(answer) if isinstance(answer, (list, tuple)) else [answer]
    out = []
    for a in items:
        if isinstance(a, float) and a.is_integer():
            a = int(a)
        s = str(a).strip()
        if s:
            out.append(s)
    return out


@dataclass
class RewardStats:
    total: int = 0
    correct: int = 0
    no_answer: int = 0
    string_match: int = 0
    symbolic_match: int = 0
    errors: int = 0
    timeouts: int = 0

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        n = max(self.total, 1)
        return {
            f"{prefix}no_answer_frac": self.no_answer / n,
            f"{prefix}symbolic_frac": self.symbolic_match / n,
            f"{prefix}error_count": float(self.errors),
            f"{prefix}timeout_count": float(self.timeouts),
        }


@dataclass
class MathVerifier:
    """``score(response, answer) -> 1.0 | wrong_value``. Reusable, counts outcomes.
    Thread-safe: calls are serialised, since one math-verify worker process answers them
    in order (OpenRLHF's rollout engine grades a prompt's samples from several threads)."""

    timeout_s: float = 5.0
    startup_timeout_s: float = 120.0
    wrong_value: float = 0.0
    symbolic: bool = True
    stats: RewardStats = field(default_factory=RewardStats)
    _proc: object = field(default=None, repr=False)
    _lock: object = field(default_factory=threading.Lock, repr=False, compare=False)

    def score(self, response: str, answer: Answer) -> float:
        with self._lock:
            return self._score(response, answer)

    def _score(self, response: str, answer: Answer) -> float:
        self.stats.total += 1
        golds = answer_strings(answer)
        pred = extract_answer(response or "")
        if pred is None or not pred.strip():
            self.stats.no_answer += 1
            return self.wrong_value
        if not golds:
            raise ValueError("reference answer is empty; drop such rows when loading data")
        np_, ng = normalize(pred), [normalize(g) for g in golds]
        if np_ in ng:
            return self._correct("string")
        pv = as_number(np_)
        gv = [as_number(g) for g in ng]
        if pv is not None and all(v is not None for v in gv):
            # plain numbers on both sides: exact rational comparison is final
            return self._correct("string") if pv in gv else self.wrong_value
        if not self.symbolic:
            return self.wrong_value
        return self._correct("symbolic") if self._symbolic(pred, golds) else self.wrong_value

    def warm(self) -> None:
        """Start the math-verify worker now and have it grade one symbolic pair, so that its
        start-up (an interpreter, sympy, the parser's first use: ~1 s) is not charged to the first
        sample that needs it (a benchmark's timed step). The outcome counts are not touched, not
        even by a time-out or an error (logged); a worker that cannot start disables symbolic
        matching, as at a sample."""
        with self._lock:
            if self.symbolic:
                counts, self.stats = self.stats, RewardStats()
                try:
                    self._symbolic("x + 1", ["1 + x"])
                finally:
                    self.stats = counts

    def score_batch(self, responses: Iterable[str], answers: Iterable[Answer]) -> list[float]:
        return [self.score(r, a) for r, a in zip(responses, answers, strict=True)]

    def _correct(self, how: str) -> float:
        self.stats.correct += 1
        if how == "string":
            self.stats.string_match += 1
        else:
            self.stats.symbolic_match += 1
        return 1.0

    def _symbolic(self, pred: str, golds: list[str]) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            try:
                self._start()
            except (OSError, RuntimeError) as e:
                # a grader that cannot start must not crash training: count it, fall back
                # to string / numeric matching for the rest of this verifier's life
                self.stats.errors += 1
                self.symbolic = False
                log.error("math-verify worker unavailable (%s); symbolic matching disabled", e)
                return False
        try:
            self._proc.stdin.write(json.dumps({"pred": pred, "golds": golds}) + "\n")
            self._proc.stdin.flush()
            line = self._readline(self.timeout_s)
        except (OSError, ValueError):
            line = ""
        if line is None:
            self.stats.timeouts += 1
            log.warning("math-verify timed out after %.1fs on %r; scored as wrong", self.timeout_s, pred[:80])
            self.close(kill=True)
            return False
        try:
            resp = json.loads(line)
        except ValueError:
            resp = {"error": "worker exited"}
            self.close()
        if "error" in resp:
            self.stats.errors += 1
            log.debug("math-verify error on %r: %s", pred[:80], resp["error"])
            return False
        return bool(resp["ok"])

    def _readline(self, timeout: float) -> str | None:
        """One line from the worker, or None after ``timeout`` seconds."""
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        return self._proc.stdout.readline() if ready else None

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hapo_openrlhf.rewards._worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        # start-up (interpreter + sympy import) is not charged to a sample's time limit
        line = self._readline(self.startup_timeout_s)
        if not line or "ready" not in line:
            self.close()
            raise RuntimeError(f"math-verify worker did not start within {self.startup_timeout_s}s")

    def close(self, kill: bool = False) -> None:
        """Stop the worker: politely (end of input), or at once with ``kill``."""
        if self._proc is not None:
            if kill:
                self._proc.kill()
            try:
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc.stdout.close()
        self._proc = None

    def __del__(self):  # best effort; close() is the real API
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
