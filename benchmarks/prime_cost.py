"""What PRIME adds to an RL step, as a ratio to GRPO measured in the same run (this CPU, 2 threads unless ``--threads``),
and by arithmetic at paper scale.

Measured on the embedded trainer (``configs/cpu_tiny_prime.yaml`` after a short warm-up): one
collected batch (``--prompts`` x 4 samples), then, interleaved ``--repeat`` times, GRPO's
training-side step on it (old log-probs, advantages, the policy's update, the entropy-after
forward the quadrant metrics read) and PRIME's (the same, plus the implicit PRM in each order:
``before`` -- reference forward, PRM forward + backward, PRM forward again; ``after`` -- reference
forward, PRM forward + backward; ``none`` -- reference and PRM forwards). Each model update is
undone between repetitions (the weights and both optimizers restored), so every repetition times
the same work. Reported: the medians, PRIME's over GRPO's, and the rollout cost of the accuracy
filter's oversampling (``oversample`` x the prompts generated per prompt trained), and the whole
embedded step's ratio (generation oversampled + the training side). The embedded training side
also runs the entropy-after forward the quadrant metrics read (F), so its GRPO is 5F.

At paper scale (a policy forward over the batch = F, a backward = 2F, one policy update = 3F): a
GRPO step's training side is the old-log-prob forward and the update, 4F (no KL reference, as the
recipe's script); PRIME adds the PRM's update (3F) and the reference's forward (F), and with
``before`` a second PRM forward (F; the reference's log-probs are reused, where the recipe runs the
reference again): 5F, i.e. 2.25x the training side (``after``: 4F, 2x). Generation
is oversampled 4x by the recipe's filter; with generation a share g of a GRPO step, the step costs
4g + 2.25 (1 - g) GRPO steps.

    python benchmarks/prime_cost.py [--prompts 16 --repeat 5 --warmup 50]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time

import torch

from hapo_openrlhf import algos
from hapo_openrlhf.algos.step import before_update
from hapo_openrlhf.config import load_config
from hapo_openrlhf.local.trainer import LocalTrainer

from _args import add_threads_argument  # benchmarks/_args.py (the script's own folder is on sys.path)


def _policy_side(tr: LocalTrainer, batch) -> None:
    """GRPO's or PRIME's training side on ``batch``, the step's work after generation (train_step's)."""
    ro = batch.rollout
    old_logp, ent = tr._behaviour(ro)
    q = None
    if tr.cfg.trains_prm:
        q, _ = tr.prm.step(ro, batch.correct, batch.group_index)
    inputs = algos.AdvantageInputs(rewards=batch.rewards, response_mask=ro.response_mask_BR, entropy=ent,
                                   group_index=batch.group_index, old_logprobs=old_logp, correct=batch.correct,
                                   step=0, response_ids=ro.response_ids_BR, process_q=q)
    step = before_update(tr.cfg.algorithm, inputs, None, old_logprobs=old_logp)
    tr._update(ro, old_logp, step.advantages, step.loss_mask, step.loss_state)
    tr._behaviour(ro)  # the entropy after the update (the quadrant metrics)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=50)
    add_threads_argument(ap)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    common = [f"warmup.steps={a.warmup}", "trainer.steps=0", "trainer.save_every=0", "trainer.sample_every=0",
              f"rollout.prompts_per_step={a.prompts}", "algorithm.accuracy_filter.oversample=1.0"]
    cfg = load_config("configs/cpu_tiny_prime.yaml", common)
    run_dir = tempfile.TemporaryDirectory(prefix="hapo_bench_")  # removed at exit
    tr = LocalTrainer(cfg, run_dir.name)
    tr.run_warmup()
    t0 = time.perf_counter()
    batch, _ = tr.collect()
    gen_s = time.perf_counter() - t0
    tr.prm = tr._build_prm()
    grpo_cfg = load_config("configs/cpu_tiny_prime.yaml", [*common, "algorithm.estimator=grpo",
                                                          "algorithm.estimator_params={}"])
    saved = (copy.deepcopy(tr.model.state_dict()), copy.deepcopy(tr.optim.state_dict()),
             copy.deepcopy(tr.prm.state_dict()))
    from dataclasses import replace

    arms = {"grpo": (grpo_cfg, None)}
    for order in ("before", "after", "none"):
        arms[f"prime_{order}"] = (replace(cfg, prm=replace(cfg.prm, update=order)), order)
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(a.repeat):
        for name, (c, order) in arms.items():  # interleaved: drift on a noisy machine hits every arm alike
            tr.model.load_state_dict(saved[0])
            tr.optim.load_state_dict(saved[1])
            tr.prm.load_state_dict(saved[2])
            tr.cfg = c
            if order:
                tr.prm.cfg = c.prm
            t0 = time.perf_counter()
            _policy_side(tr, batch)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    oversample = load_config("configs/cpu_tiny_prime.yaml").algorithm.accuracy_filter.oversample  # the shipped one
    out = {"rows": int(batch.rewards.numel()), "repeat": a.repeat, "generation_s": round(gen_s, 4),
           "oversample_rollout_ratio": oversample}
    print(f"embedded batch: {out['rows']} responses; generation {gen_s * 1e3:.0f} ms, x{oversample:g} with the "
          f"recipe's oversampling (the shipped config's)")
    for k, v in med.items():
        ratio = v / med["grpo"]
        out[k] = {"median_ms": round(v * 1e3, 2), "min_ms": round(min(times[k]) * 1e3, 2),
                  "max_ms": round(max(times[k]) * 1e3, 2), "ratio_to_grpo": round(ratio, 3)}
        print(f"  {k:13s} training side {v * 1e3:8.1f} ms (range {min(times[k]) * 1e3:.1f}-"
              f"{max(times[k]) * 1e3:.1f})  x{ratio:.2f} GRPO")
    # the whole embedded step: generation (oversampled under PRIME) + the training side
    out["embedded_step_ratio_before"] = round((oversample * gen_s + med["prime_before"]) / (gen_s + med["grpo"]), 3)
    print(f"embedded step (generation x{oversample:g} + training side) over GRPO's: x{out['embedded_step_ratio_before']}")
    # paper scale, in forwards F over the batch (module docstring)
    paper = {"grpo_F": 4, "prime_before_F": 9, "prime_after_F": 8, "training_side_ratio_before": 9 / 4,
             "training_side_ratio_after": 8 / 4,
             "step_ratio_before_by_generation_share": {str(g): round(4 * g + 9 / 4 * (1 - g), 3)
                                                       for g in (0.5, 0.6, 0.7)}}
    out["paper_scale"] = paper
    out["threads"] = a.threads
    print("paper scale: GRPO 4F; PRIME before 9F (x2.25), after 8F (x2); with 4x oversampled generation at a "
          "share g of a GRPO step: " + ", ".join(f"g={g}: x{r}" for g, r in
                                                 paper["step_ratio_before_by_generation_share"].items()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
