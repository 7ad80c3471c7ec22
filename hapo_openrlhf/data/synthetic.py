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

The *chain* variant (``min_terms`` < ``n_terms``, ``skip_prob`` > 0; issue 28's testbed)
gives longer responses with several forks each: problems have ``min_terms .. n_terms``
terms, and before each step but the last the teacher skips the intermediate result with
probability ``skip_prob``, writing two operations at once ("47+38-19=66.") and getting
that merged step wrong by +-1 or +-2 with probability ``skip_error``. Every step is then
a decision (write the intermediate or not) followed by result digits whose reliability
depends on it: 4-6 single-digit terms give 30-60-token responses with 3-5 forks.
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
    min_terms: int | None = None  # the chain variant: min_terms .. n_terms terms per problem
    skip_prob: float = 0.0  # per step: the teacher skips the intermediate result (two ops at once)
    skip_error: float = 0.0  # how often such a merged step is a near miss (+-1 or +-2)

    def __post_init__(self):
        probs = (self.slip_prob, self.shortcut_prob, self.skip_prob)
        if not (all(0 <= p < 1 for p in probs) and 0 <= self.shortcut_error <= 1 and 0 <= self.skip_error <= 1):
            raise ValueError(f"slip_prob, shortcut_prob and skip_prob must be in [0, 1), shortcut_error and "
                             f"skip_error in [0, 1], got {self}")
        if self.n_terms < 2 or self.digits < 1 or not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"invalid arithmetic task {self}: n_terms >= 2, digits >= 1, ops within '+-*'")
        if self.min_terms is not None and not 2 <= self.min_terms <= self.n_terms:
            raise ValueError(f"min_terms must be in [2, n_terms={self.n_terms}], got {self.min_terms}")

    def sample(self, rng: random.Random) -> tuple[str, list[str], int]:
        hi = 10**self.digits - 1
        n = self.n_terms if self.min_terms is None else rng.randint(self.min_terms, self.n_terms)
        nums = [rng.randint(1, hi) for _ in range(n)]
        ops = [rng.choice(self.ops) for _ in range(n - 1)]
        text = str(nums[0]) + "".join(o + str(n) for o, n in zip(ops, nums[1:]))
        steps, acc = [], nums[0]
        for o, n in zip(ops, nums[1:]):
            new = acc + n if o == "+" else acc - n if o == "-" else acc * n
            steps.append(f"{acc}{o}{n}={new}.")
            acc = new
        return text, steps, acc

    def distinct_problems(self) -> int:
        """How many distinct problem texts ``sample`` can produce (both sides of the split)."""
        hi, n_ops = 10**self.digits - 1, len(set(self.ops))
        lo = self.n_terms if self.min_terms is None else self.min_terms
        return sum(hi**n * n_ops ** (n - 1) for n in range(lo, self.n_terms + 1))

    def side_capacity(self, heldout: bool) -> int:
        """About how many distinct problems one side of the split holds (the hash buckets
        split the problem texts evenly in expectation)."""
        total = self.distinct_problems()
        return total // self.heldout_buckets if heldout else total - total // self.heldout_buckets

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
        pairs = [(o, int(n)) for o, n in zip(toks[1::2], toks[2::2])]
        i = 0
        while i < len(pairs):
            o, n = pairs[i]
            new = acc + n if o == "+" else acc - n if o == "-" else acc * n
            text = f"{acc}{o}{n}"
            err = self.slip_prob
            if rng is not None and self.skip_prob and i + 1 < len(pairs) and rng.random() < self.skip_prob:
                o2, n2 = pairs[i + 1]  # skip the intermediate: two operations in one step
                new = new + n2 if o2 == "+" else new - n2 if o2 == "-" else new * n2
                text += f"{o2}{n2}"
                err = self.skip_error
                i += 1
            if rng is not None and err and rng.random() < err:
                new += rng.choice((-2, -1, 1, 2))
            steps.append(f"{text}={new}.")
            acc = new
            i += 1
        if rng is not None and self.shortcut_prob and rng.random() < self.shortcut_prob:
            if rng.random() < self.shortcut_error:
                acc += rng.choice((-2, -1, 1, 2))
            return f"\\boxed{{{acc}}}"
        return " ".join(steps) + f" \\boxed{{{acc}}}"
