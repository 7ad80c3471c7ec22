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


def grpo_step_batches(steps: int, warmup: int = 50, threads: int = 2) -> Iterator[tuple[algos.AdvantageInputs, float]]:
    """(the step's estimator inputs, the step's wall time in s) for steps 2..``steps``, at ``threads``
    intra-op threads."""
    torch.set_num_threads(threads)
    cfg = load_config("configs/cpu_tiny.yaml", [f"warmup.steps={warmup}", f"trainer.steps={steps}",
                                                "trainer.save_every=0", "trainer.sample_every=0",
                                                "algorithm.estimator=grpo", "algorithm.estimator_params={}",
                                                "algorithm.dynamic_sampling=false"])
    run_dir = tempfile.TemporaryDirectory(prefix="hapo_bench_")
    tr = LocalTrainer(cfg, run_dir.name)
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
        run_dir.cleanup()


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` wall times of ``fn()``, in s (the least disturbed run)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def peaked_hidden(h: torch.Tensor, w: torch.Tensor, g: torch.Generator, boost_lo: float = 15.0,
                  boost_hi: float = 27.0, spread: float = 24.0) -> torch.Tensor:
    """Hidden states [N, H] whose logits through the head ``w`` [V, H] look like a trained model's
    (benchmarks/head_signals.py): four candidate tokens per row (random rows of the head), the first
    raised by c ~ U(boost_lo, boost_hi) nats over h's logits, the other three by c - U(0, spread)."""
    N, V = h.shape[0], w.shape[0]
    tok = torch.randint(0, V, (N, 4), generator=g)
    c = torch.empty(N, 1).uniform_(boost_lo, boost_hi, generator=g)
    c = torch.cat([c, c - torch.empty(N, 3).uniform_(0, spread, generator=g)], 1)
    wt = w[tok]  # [N, 4, H]: each candidate's logit raised by c (its head row over its squared norm)
    return h + (c.unsqueeze(-1) * wt / (wt * wt).sum(-1, keepdim=True)).sum(1)
