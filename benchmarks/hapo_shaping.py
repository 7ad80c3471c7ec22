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

import torch

from hapo_openrlhf import algos

from _embedded import best_of, grpo_step_batches  # benchmarks/_embedded.py (the script's own folder is on sys.path)


def _time_estimators(inputs, repeat):
    t_grpo = best_of(lambda: algos.run_estimator("grpo", inputs), repeat)
    t_hapo = best_of(lambda: algos.run_estimator("hapo", inputs, alpha=0.2, phi=2.0), repeat)
    return t_grpo, t_hapo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    steps, shaping = [], []
    for inputs, step_s in grpo_step_batches(a.steps):
        t_grpo, t_hapo = _time_estimators(inputs, a.repeat)
        steps.append(step_s)
        shaping.append(t_hapo - t_grpo)
    B, T = inputs.response_mask.shape
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
