"""Pass@k (Chen et al. 2021, unbiased) and Avg@k."""

from __future__ import annotations

from typing import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), in the stable product form prod_{i=n-c+1}^{n} (1 - k/i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def avg_at_k(correct: Sequence[Sequence[float]]) -> float:
    """Mean accuracy over all samples of all problems (each inner list: one problem's k
    scores; a score > 0.5 counts as correct, so 0/1 and -1/1 rewards both work)."""
    if not correct:
        raise ValueError("avg_at_k needs at least one problem")
    return sum(sum(x > 0.5 for x in c) / len(c) for c in correct) / len(correct)


def summarize_samples(correct: Sequence[Sequence[float]], k: int | None = None) -> dict[str, float]:
    """Avg@n and Pass@k (k defaults to n) for per-problem lists of 0/1 scores."""
    n = len(correct[0])
    k = k or n
    return {
        f"avg@{n}": avg_at_k(correct),
        f"pass@{k}": sum(pass_at_k(len(c), int(sum(x > 0.5 for x in c)), k) for c in correct) / len(correct),
    }
