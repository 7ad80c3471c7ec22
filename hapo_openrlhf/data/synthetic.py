"""The embedded default task: multi-step integer arithmetic with verifiable answers.

"Q: 47+38-19\nA: " -> "47+38=85. 85-19=66. \\boxed{66}". The worked chain is the
supervised warm-up target; RL only sees the final ``\\boxed{}`` answer.

The warm-up "teacher" slips: with probability ``slip_prob`` each step's result is
off by 1 or 2 and the chain carries the error on, as a real reasoning slip does.
With probability ``shortcut_prob`` the teacher skips the chain and states an
answer directly, a near-miss guess with probability ``shortcut_error``. The
warm-started policy thus knows the computation but is uncertain where to spend
it: its first token is a high-entropy fork (work it out / guess) and its result
tokens are uncertain; that is the regime RLVR sharpens. Train and
held-out problems are disjoint by construction (a hash bucket of the problem text).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from .loader import Problem


@dataclass(frozen=True)
class ArithmeticTask:
    n_terms: int = 3
    digits: int = 2
    ops: str = "+-"
    heldout_buckets: int = 10  # 1 in this many problems is held out
    slip_prob: float = 0.0  # per-step error rate of the warm-up solutions
    shortcut_prob: float = 0.0  # share of warm-up solutions that skip the worked chain
    shortcut_error: float = 0.0  # how often such a direct answer is a (near-miss) guess

    def __post_init__(self):
        if not (0 <= self.slip_prob < 1 and 0 <= self.shortcut_prob < 1 and 0 <= self.shortcut_error <= 1):
            raise ValueError(f"slip_prob and shortcut_prob must be in [0, 1), got {self}")
        if self.n_terms < 2 or self.digits < 1 or not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"invalid arithmetic task {self}: n_terms >= 2, digits >= 1, ops within '+-*'")

    def sample(self, rng: random.Random) -> tuple[str, list[str], int]:
        hi = 10**self.digits - 1
        nums = [rng.randint(1, hi) for _ in range(self.n_terms)]
        ops = [rng.choice(self.ops) for _ in range(self.n_terms - 1)]
        text = str(nums[0]) + "".join(o + str(n) for o, n in zip(ops, nums[1:]))
        steps, acc = [], nums[0]
        for o, n in zip(ops, nums[1:]):
            new = acc + n if o == "+" else acc - n if o == "-" else acc * n
            steps.append(f"{acc}{o}{n}={new}.")
            acc = new
        return text, steps, acc

    def is_heldout(self, text: str) -> bool:
        h = int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "little")
        return h % self.heldout_buckets == 0

    def problems(self, n: int, seed: int, heldout: bool) -> list[Problem]:
        """``n`` distinct problems from one side of the split, deterministic in ``seed``."""
        rng, out, seen = random.Random(seed), [], set()
        for _ in range(n * 50):
            text, _, ans = self.sample(rng)
            if text in seen or self.is_heldout(text) != heldout:
                continue
            seen.add(text)
            out.append(Problem(text, (str(ans),), f"arith-{seed}-{len(out)}", "synthetic"))
            if len(out) == n:
                return out
        raise ValueError(f"could not draw {n} distinct {'held-out' if heldout else 'train'} problems from {self}")

    def solution(self, problem: str, rng: random.Random | None = None) -> str:
        """The worked answer for a problem produced by ``sample``; with ``rng`` and
        ``slip_prob`` > 0, each step slips by +-1 or +-2 with that probability."""
        import re

        toks = re.findall(r"\d+|[+\-*]", problem)
        acc, steps = int(toks[0]), []
        for o, n in zip(toks[1::2], toks[2::2]):
            n = int(n)
            new = acc + n if o == "+" else acc - n if o == "-" else acc * n
            if rng is not None and self.slip_prob and rng.random() < self.slip_prob:
                new += rng.choice((-2, -1, 1, 2))
            steps.append(f"{acc}{o}{n}={new}.")
            acc = new
        if rng is not None and self.shortcut_prob and rng.random() < self.shortcut_prob:
            if rng.random() < self.shortcut_error:
                acc += rng.choice((-2, -1, 1, 2))
            return f"\\boxed{{{acc}}}"
        return " ".join(steps) + f" \\boxed{{{acc}}}"
