"""Embedded trainer vs TRL's GRPOTrainer: end-to-end tokens/s on the same work.

Same tiny Qwen2 (the embedded default's architecture and char tokenizer, warm-started
by the embedded SFT warm-up, then saved and loaded by both), same training prompts
(templated identically), same group size, batch, sampling (T 1.0, top-p 0.95) and
response budget, same PPO-clip loss (eps 0.2 / 0.28, token-mean, no KL, one update
per batch), one optimizer step per rollout batch, both on this CPU with the same
thread count. The embedded trainer runs GRPO advantages (TRL has no HAPO) without
dynamic sampling or the overlong penalty, so both generate exactly one batch a step.

Tokens/s = generated response tokens (EOS included) / wall time of the step
(generation + reward + old-log-prob/scoring forwards + update), step 1 excluded as
warm-up. TRL's per-step count comes from its logged ``completions/mean_length``.

    pip install trl==1.16.0
    python benchmarks/vs_trl.py [--steps 8 --prompts 16 --group 8 --max-new-tokens 40]

Prints one line per trainer and, last, one JSON object with ``ratio_ours_vs_trl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _cfg(args):
    from hapo_openrlhf.config import load_config

    return load_config(REPO / "configs" / "cpu_tiny.yaml", [
        f"warmup.steps={args.warmup_steps}", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.group}", f"rollout.max_new_tokens={args.max_new_tokens}",
        "algorithm.estimator=grpo", "algorithm.estimator_params={}", "algorithm.dynamic_sampling=false",
        "algorithm.overlong.enable=false", f"optim.micro_batch_size={args.prompts * args.group}",
        "trainer.save_every=0", "trainer.eval_every=0", f"trainer.threads={args.threads}",
    ])


def run_ours(cfg, out: Path, steps: int) -> dict:
    from hapo_openrlhf.local.trainer import LocalTrainer

    t = LocalTrainer(cfg, out / "ours")
    t.run_warmup()
    from hapo_openrlhf.local.model import save_hf

    save_hf(t.model, t.tok, out / "warm")
    # the data position after warm-up is the start of RL for both trainers
    prompts = [p for p in t.train_problems]
    rows = []
    for _ in range(steps):
        m = t.train_step()
        rows.append((m["response/tokens"], m["time/step_s"]))
    return {"rows": rows, "train_problems": prompts}


def run_trl(cfg, out: Path, steps: int, problems) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hapo_openrlhf.data.templates import apply_template
    from hapo_openrlhf.data.tokenizer import load_tokenizer
    from hapo_openrlhf.rewards.verify import MathVerifier

    tok = load_tokenizer(out / "warm")
    model = AutoModelForCausalLM.from_pretrained(out / "warm", dtype=torch.float32)
    verifier = MathVerifier()
    r = cfg.rollout

    def reward(prompts, completions, answer, **_):
        return verifier.score_batch(completions, answer)

    ds = Dataset.from_list([{"prompt": apply_template(cfg.data.template, p.problem), "answer": str(p.answer)}
                            for p in problems])

    class Clock(TrainerCallback):
        def __init__(self):
            self.t0, self.times, self.lengths = 0.0, [], []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    B = r.prompts_per_step * r.samples_per_prompt
    targs = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        max_steps=steps, per_device_train_batch_size=B, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=r.samples_per_prompt, max_completion_length=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, top_k=0, learning_rate=cfg.optim.lr, beta=0.0,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, num_iterations=1, logging_steps=1,
        seed=cfg.seed, dataloader_num_workers=0, remove_unused_columns=False, lr_scheduler_type="constant",
        max_grad_norm=cfg.optim.grad_clip, shuffle_dataset=True,
    )
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=targs, train_dataset=ds, processing_class=tok,
                          callbacks=[clock])
    trainer.train()
    rows = [(length * B, dt) for length, dt in zip(clock.lengths, clock.times)]
    return {"rows": rows}


def _summary(name: str, rows) -> dict:
    steady = rows[1:] or rows
    tok = sum(n for n, _ in steady)
    sec = sum(t for _, t in steady)
    res = {"trainer": name, "steps_timed": len(steady), "tokens": tok, "seconds": sec, "tokens_per_s": tok / sec,
           "median_step_s": statistics.median(t for _, t in steady),
           "mean_response_len": tok / len(steady) / max(1, ARGS.prompts * ARGS.group)}
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--warmup-steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ARGS = args = ap.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/vs_trl.py needs TRL: pip install trl==1.16.0")
    torch.set_num_threads(args.threads)
    cfg = _cfg(args)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        ours = run_ours(cfg, out, args.steps)
        trl_res = run_trl(cfg, out, args.steps, ours["train_problems"])
    a, b = _summary("hapo-openrlhf (embedded)", ours["rows"]), _summary(f"trl {trl.__version__} GRPOTrainer", trl_res["rows"])
    print(json.dumps({"ours_tokens_per_s": a["tokens_per_s"], "trl_tokens_per_s": b["tokens_per_s"],
                      "ratio_ours_vs_trl": a["tokens_per_s"] / b["tokens_per_s"],
                      "ours_median_step_s": a["median_step_s"], "trl_median_step_s": b["median_step_s"],
                      "ours_mean_response_len": a["mean_response_len"], "trl_mean_response_len": b["mean_response_len"],
                      "steps": args.steps, "batch": args.prompts * args.group, "group": args.group}))


if __name__ == "__main__":
    main()
