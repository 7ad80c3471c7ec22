"""HAPO shaping cost as a fraction of a GRPO training step (embedded trainer, this CPU).

Runs the embedded trainer with the GRPO estimator for a few RL steps (step time
measured by the trainer, first step skipped), and on each step's real batch times
the advantage computation of ``grpo`` and of ``hapo`` (alpha 0.2, phi 2), best of
``--repeat`` runs. The shaping cost is ``(t_hapo - t_grpo) / t_step``. The same
estimators are also timed on a synthetic paper-scale batch (1024 samples x 4096
tokens) to show how the cost scales (no step time exists for that on CPU).

    python benchmarks/hapo_shaping.py [--steps 4 --repeat 20]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from hapo_openrlhf import algos
from hapo_openrlhf.config import load_config
from hapo_openrlhf.local.trainer import LocalTrainer


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _time_estimators(inputs, repeat):
    t_grpo = _best(lambda: algos.run_estimator("grpo", inputs), repeat)
    t_hapo = _best(lambda: algos.run_estimator("hapo", inputs, alpha=0.2, phi=2.0), repeat)
    return t_grpo, t_hapo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    torch.set_num_threads(2)
    cfg = load_config("configs/cpu_tiny.yaml", ["warmup.steps=50", f"trainer.steps={a.steps}", "trainer.save_every=0",
                                                "trainer.sample_every=0", "algorithm.estimator=grpo",
                                                "algorithm.estimator_params={}", "algorithm.dynamic_sampling=false"])
    tr = LocalTrainer(cfg, tempfile.mkdtemp())
    tr.run_warmup()
    captured = []
    orig = algos.run_estimator

    def spy(name, inputs, **kw):
        captured.append(inputs)
        return orig(name, inputs, **kw)

    import hapo_openrlhf.local.trainer as lt

    lt.algos.run_estimator = spy
    steps, shaping = [], []
    for i in range(a.steps):
        m = tr.train_step()
        if i == 0:
            continue
        t_grpo, t_hapo = _time_estimators(captured[-1], a.repeat)
        steps.append(m["time/step_s"])
        shaping.append(t_hapo - t_grpo)
    lt.algos.run_estimator = orig
    B, T = captured[-1].response_mask.shape
    step_s = sum(steps) / len(steps)
    extra_s = sum(shaping) / len(shaping)
    print(f"embedded step ({B} samples x {T} tokens): {step_s * 1e3:.1f} ms; hapo - grpo estimator: {extra_s * 1e3:.3f} ms")
    g = torch.Generator().manual_seed(0)
    Bp, Tp = 1024, 4096
    lens = torch.randint(Tp // 4, Tp + 1, (Bp,), generator=g)
    mask = torch.arange(Tp)[None] < lens[:, None]
    big = algos.AdvantageInputs(rewards=(torch.rand(Bp, generator=g) > 0.5).float(), response_mask=mask,
                                entropy=torch.rand(Bp, Tp, generator=g) * mask, group_index=torch.arange(Bp) // 8)
    bg, bh = _time_estimators(big, 3)
    print(f"paper-scale batch ({Bp} x {Tp}): grpo {bg * 1e3:.1f} ms, hapo {bh * 1e3:.1f} ms on this CPU")
    print(json.dumps({
        "step_s": step_s, "hapo_minus_grpo_s": extra_s, "shaping_fraction_of_grpo_step": extra_s / step_s,
        "batch": [B, T], "paper_scale_batch": [Bp, Tp], "paper_scale_grpo_s": bg, "paper_scale_hapo_s": bh,
    }))


if __name__ == "__main__":
    main()
