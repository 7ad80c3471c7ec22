"""Non-finite gradients: skip the update, count it, stop after N in a row.

One rule for the embedded trainer, the DeepSpeed actor and the Megatron actor. Without a
loss scaler (bf16, fp32) neither megatron-core nor DeepSpeed's ZeRO-3 checks gradients
for inf/NaN, and ``clip_grad_norm`` does not clip at a NaN norm (``nan < max_norm`` is
False), so one bad micro-batch would reach the fp32 masters, the Adam moments and, at the
next weight sync, the rollout engine. Here:

* each back end reduces two flags (any NaN, any inf) over every rank before the
  optimizer step -- one small all-reduce and one host sync per optimizer step;
* a non-finite step is skipped: weights, Adam moments, the optimizer's step count and the
  LR schedule are untouched, the gradients are cleared;
* ``actor/skipped_steps`` counts skips (cumulative, kept in checkpoints), the offending
  norm is logged as ``nan`` / ``inf`` (what the L2 norm of those gradients is);
* ``optim.max_consecutive_skips`` skips in a row stop the run with
  :class:`NonFiniteGradientError` (the last checkpoint is intact).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch


class NonFiniteGradientError(FloatingPointError):
    """Too many optimizer steps in a row had a non-finite gradient."""


def nonfinite_flags(grads: Iterable[torch.Tensor | None], out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``[any NaN, any inf]`` over ``grads`` as a float tensor on their device, OR-ed into
    ``out`` when given. No host sync (the flags stay on the device until :func:`norm_from_flags`),
    and no tensor of a gradient's size: one min/max reduction per gradient (both propagate NaN;
    an inf is the max or the min), where ``isnan()`` / ``isinf()`` would each allocate a bool
    copy of it (7.6 GB transient over a 7B model's fp32 gradient buffer)."""
    for g in grads:
        if g is None or g.numel() == 0:
            continue
        lo, hi = torch.aminmax(g)
        f = torch.stack([hi.isnan(), hi.isposinf() | lo.isneginf()]).float()
        out = f if out is None else torch.maximum(out, f.to(out.device))
    return out


def norm_from_flags(flags: torch.Tensor | None, group=None, device=None) -> float | None:
    """Reduce the flags over ``group`` (every rank when torch.distributed is up; ``device``:
    where a rank that saw no gradient makes its zero flags -- NCCL reduces device tensors only) and read them:
    ``nan`` when any rank saw a NaN, ``inf`` when one saw an inf and none a NaN (the L2 norm
    of such gradients), ``None`` when every gradient is finite."""
    import torch.distributed as dist

    if flags is None:
        flags = torch.zeros(2, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    nan, inf = (bool(v) for v in flags.tolist())
    return math.nan if nan else (math.inf if inf else None)


class SkipGuard:
    """Counts skipped optimizer steps; :meth:`update` says whether to skip and raises
    :class:`NonFiniteGradientError` at ``max_consecutive`` skips in a row."""

    def __init__(self, max_consecutive: int, where: str = "the actor") -> None:
        if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) or max_consecutive < 1:
            raise ValueError(f"optim.max_consecutive_skips must be an integer >= 1, got {max_consecutive!r}")
        self.max_consecutive = max_consecutive
        self.where = where
        self.skipped = 0  # cumulative (checkpointed)
        self.consecutive = 0

    def update(self, norm: float | None, step: int) -> bool:
        """``norm``: the step's gradient norm (None or finite: apply the update). Returns True
        when the update must be skipped."""
        if norm is None or math.isfinite(norm):
            self.consecutive = 0
            return False
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            raise NonFiniteGradientError(
                f"{self.where}: non-finite gradient norm ({norm}) at optimizer step {step}, "
                f"{self.consecutive} step(s) in a row (optim.max_consecutive_skips = {self.max_consecutive}); "
                f"every one was skipped, the weights and the last checkpoint are intact")
        return True

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.consecutive = int(state.get("consecutive", 0))

