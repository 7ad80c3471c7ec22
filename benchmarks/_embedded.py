"""Shared by the estimator benchmarks: the embedded trainer's real rollout batches (a GRPO
run after a short supervised warm-up, each step's ``AdvantageInputs`` captured as the
trainer hands them to the registry; the first step skipped: it pays one-off costs), and
best-of-n timing."""

from __future__ import annotations

import tempfile
import time
from typing import Callable, Iterator

import torch

from hapo_openrlhf import algos
from hapo_openrlhf.config import load_config
from hapo_openrlhf.local.trainer import LocalTrainer


def grpo_step_batches(steps: int, warmup: int = 50) -> Iterator[tuple[algos.AdvantageInputs, float]]:
    """(the step's estimator inputs, the step's wall time in s) for steps 2..``steps``."""
    torch.set_num_threads(2)
    cfg = load_config("configs/cpu_tiny.yaml", [f"warmup.steps={warmup}", f"trainer.steps={steps}",
                                                "trainer.save_every=0", "trainer.sample_every=0",
                                                "algorithm.estimator=grpo", "algorithm.estimator_params={}",
                                                "algorithm.dynamic_sampling=false"])
    tr = LocalTrainer(cfg, tempfile.mkdtemp())
    tr.run_warmup()
    captured = []
    # the trainer reaches the estimator through the algorithm's step (algos/step.py)
    import hapo_openrlhf.algos.step as step

    orig = step.run_estimator

    def spy(name, inputs, **kw):
        captured.append(inputs)
        return orig(name, inputs, **kw)

    step.run_estimator = spy
    try:
        for i in range(steps):
            m = tr.train_step()
            if i:
                yield captured[-1], m["time/step_s"]
    finally:
        step.run_estimator = orig


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` wall times of ``fn()``, in s (the least disturbed run)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
