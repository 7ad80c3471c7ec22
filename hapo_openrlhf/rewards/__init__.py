"""Rule-based math rewards: last \\boxed{} extraction, string match, math-verify."""

from __future__ import annotations

from .extract import extract_answer, last_boxed, normalize, strip_thinking
from .verify import Answer, MathVerifier, RewardStats, answer_strings

_DEFAULT: MathVerifier | None = None


def score(response: str, answer: Answer) -> float:
    """1.0 if the last \\boxed{} answer of ``response`` equals ``answer``, else 0.0."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = MathVerifier()
    return _DEFAULT.score(response, answer)


__all__ = [
    "Answer", "MathVerifier", "RewardStats", "answer_strings", "extract_answer", "last_boxed",
    "normalize", "score", "strip_thinking",
]
