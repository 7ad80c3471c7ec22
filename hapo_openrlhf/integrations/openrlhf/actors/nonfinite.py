"""The non-finite-gradient rule (``hapo_openrlhf/grad_guard.py``) on OpenRLHF's DeepSpeed actor.

What DeepSpeed 0.19.6 does by itself without a loss scaler (read in its source):

* ZeRO-1/2 under bf16 checks for inf/NaN (``bf16.check_grad_overflow``, on by default) and
  skips the step -- silently: OpenRLHF logs the previous step's norm
  (``get_global_grad_norm``), and a non-finite norm reads -1 there;
* ZeRO-3 checks only under fp16 (``stage3.py``, ``_overflow_check_and_loss_scale_update``);
* ZeRO-0 (``BF16_Optimizer`` under bf16, the torch optimizer under fp32) never checks.

So the actor watches its gradients itself: a tensor hook on every trainable parameter ORs
``[any NaN, any inf]`` into a device flag as each micro-batch's gradient arrives (before
DeepSpeed's own hooks reduce and partition it -- the same on every ZeRO stage, no host
sync); at the optimizer step the flags are reduced over every rank, and a bad step takes
DeepSpeed's own skip path (``overflow``: the gradients are cleared, the optimizer and the
LR scheduler do not step, ``engine.skipped_steps`` counts it). DeepSpeed's own check still
runs where it exists; a step it skips (a sum of finite parts that overflowed) counts too.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ....algos.grad_guard import SkipGuard, nonfinite_flags, norm_from_flags


@contextlib.contextmanager
def _forced_skip(opt):
    """Make the engine's next ``optimizer.step()`` DeepSpeed's overflow skip."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(opt, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        # their step() reads self.overflow after check_overflow() (which would recompute it):
        # overflow -> clear the gradients, no step; the engine then counts a skipped step
        opt.check_overflow = lambda *a, **k: None
        opt.overflow = True
        try:
            yield
        finally:
            del opt.check_overflow  # the class's method again
            opt.overflow = False
        return
    # ZeRO-0: BF16_Optimizer (fp32 gradients accumulated beside the bf16 ones) or a torch
    # optimizer. The engine reads `overflow` after step() when the optimizer has one
    def skip(*a, **k):
        if hasattr(opt, "clear_hp_grads"):
            opt.clear_hp_grads()
        opt.zero_grad()

    had_overflow = hasattr(opt, "overflow")
    opt.step, opt.overflow = skip, True
    try:
        yield
    finally:
        del opt.step
        if had_overflow:
            opt.overflow = False
        else:
            del opt.overflow


class DeepSpeedGradGuard:
    """Installed on the actor's DeepSpeed engine; :meth:`step` replaces ``engine.step()``.
    :attr:`norm` is the step's gradient norm before clipping (nan / inf for a skipped step)."""

    def __init__(self, engine, max_consecutive: int) -> None:
        self.engine = engine
        self.guard = SkipGuard(max_consecutive, "the DeepSpeed actor")
        self.flags: torch.Tensor | None = None
        self.norm: float | None = None
        self.hooks = [p.register_hook(self._observe) for p in engine.module.parameters() if p.requires_grad]

    def _observe(self, grad: torch.Tensor) -> None:
        self.flags = nonfinite_flags([grad.detach()], self.flags)

    @property
    def skipped(self) -> int:
        """Steps skipped so far: DeepSpeed's count (in its checkpoints, so it survives a resume)."""
        return int(self.engine.skipped_steps)

    def step(self) -> None:
        """``engine.step()``, called after every micro-batch's backward as OpenRLHF does; the
        flags are read at the gradient-accumulation boundary, where DeepSpeed steps."""
        engine = self.engine
        if not engine.is_gradient_accumulation_boundary():
            engine.step()  # DeepSpeed only counts the micro-batch
            return
        # over every rank: the ranks skip together
        bad = norm_from_flags(self.flags, device=next(engine.module.parameters()).device)
        self.flags = None
        before = engine.skipped_steps
        with _forced_skip(engine.optimizer) if bad is not None else contextlib.nullcontext():
            engine.step()
        if bad is None and engine.skipped_steps > before:
            bad = math.inf  # DeepSpeed's own overflow check skipped it (finite parts, non-finite sum)
        if bad is None:
            norm = engine.get_global_grad_norm()
            self.norm = float(norm) if norm is not None else 0.0
        else:
            self.norm = bad
        self.guard.update(bad, step=int(engine.global_steps))
