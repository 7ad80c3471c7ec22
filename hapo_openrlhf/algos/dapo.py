"""DAPO pieces (Yu et al. 2025): dynamic sampling and the soft overlong penalty.

Clip-higher and token-mean aggregation live in ``losses.ppo`` / ``losses.aggregate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def informative_groups(rewards_B: torch.Tensor, group_index_B: torch.Tensor, tol: float = 1e-8) -> torch.Tensor:
    """Bool [B]: True where the sequence's group has non-zero reward variance."""
    _, gid = torch.unique(group_index_B, return_inverse=True)
    K = int(gid.max()) + 1 if gid.numel() else 0
    r = rewards_B.double()
    big = torch.full((K,), float("inf"), dtype=torch.float64, device=r.device)
    lo = big.scatter_reduce(0, gid, r, reduce="amin")
    hi = (-big).scatter_reduce(0, gid, r, reduce="amax")
    return (hi - lo)[gid] > tol


def overlong_penalty(lengths_B: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward. [B] float.

    0 if L <= max_len - cache_len; (max_len - cache_len - L) / cache_len in the
    cache window (linear from 0 to -1); -1 beyond max_len.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong cache_len must be in (0, max_len={max_len}], got {cache_len}")
    L = lengths_B.float()
    soft = max_len - cache_len
    pen = torch.where(L <= soft, torch.zeros_like(L), (soft - L) / cache_len)
    return pen.clamp(min=-1.0)


@dataclass
class DynamicSamplingBuffer:
    """Collects whole prompt groups until ``target_groups`` informative ones are held.

    Groups whose rewards all agree carry no GRPO signal and are dropped (counted);
    a trainer keeps generating (up to ``max_rounds``) until ``ready``. Items are any
    per-group payload the trainer wants back.
    """

    target_groups: int
    max_rounds: int = 10
    groups: list[Any] = field(default_factory=list)
    rounds: int = 0
    dropped: int = 0
    seen: int = 0

    def add(self, payloads: list[Any], informative: list[bool]) -> None:
        if len(payloads) != len(informative):
            raise ValueError("payloads and informative flags differ in length")
        self.rounds += 1
        self.seen += len(payloads)
        for p, ok in zip(payloads, informative):
            if ok:
                self.groups.append(p)
            else:
                self.dropped += 1

    @property
    def ready(self) -> bool:
        return len(self.groups) >= self.target_groups

    @property
    def exhausted(self) -> bool:
        return self.rounds >= self.max_rounds

    def take(self) -> list[Any]:
        """The first ``target_groups`` groups (fewer if rounds ran out); surplus is dropped."""
        out, self.groups = self.groups[: self.target_groups], []
        return out

    def metrics(self) -> dict[str, float]:
        return {
            "dapo/gen_rounds": float(self.rounds),
            "dapo/dropped_group_frac": self.dropped / max(self.seen, 1),
        }
