"""Embedded trainer vs TRL's GRPOTrainer: end-to-end tokens/s on the same work.

Same tiny Qwen2 (the embedded default's architecture and char tokenizer, or ``--config``'s,
warm-started by the embedded SFT warm-up, then saved and loaded by both), same training prompts
(templated identically), same group size, batch, sampling (T 1.0, top-p 0.95) and
response budget, same PPO-clip loss (eps 0.2 / 0.28, token-mean, no KL, one update
per batch), one optimizer step per rollout batch, both on this CPU with the same
thread count. The embedded trainer runs GRPO advantages (TRL has no HAPO) without
dynamic sampling or the overlong penalty, so both generate exactly one batch a step.

Tokens/s = generated response tokens (EOS included) / wall time of the step
(generation + reward + old-log-prob/scoring forwards + update), step 1 excluded as
warm-up. TRL's per-step count comes from its logged ``completions/mean_length``.

Both trainers' verifiers are warmed before their first step (``MathVerifier.warm``): the math-verify
worker starts on the first sample that needs symbolic grading, about 1 s once per run (an interpreter,
sympy, the parser's first use), which had landed in the embedded trainer's step 16 of every
``--steps 16`` run (a 0.7 s step among 0.15 s ones) and in TRL's wherever its first such sample fell.

Both trainers are graded alike: TRL's reward function hands the verifier the same answers the
embedded trainer grades against (issue 60: it used to get ``str(answer)`` of a tuple, which
never matched, so TRL trained on all-zero rewards). Each run prints both trainers' per-step
mean rewards, and a run where either is constant gives no ratio. ``--runs`` interleaved runs
(ours, TRL, ours with the re-scoring, ours, TRL, ...) from one saved warm start; the median ratio
and the range. "The same work": the embedded trainer without its re-scoring forward after each
update (``trainer.entropy_change_every: 0``: the per-quadrant entropy change, a diagnostic TRL
does not compute; tested to change nothing else); the ratio with it is printed beside.

    pip install trl==1.16.0
    python benchmarks/vs_trl.py [--runs 5 --steps 8 --prompts 16 --group 8 --max-new-tokens 40]
    python benchmarks/vs_trl.py --config configs/cpu_tiny_chain.yaml --warmup-steps 1000 --max-new-tokens 80

Last line: one JSON object with ``median_ratio`` and every run's rewards and ratio.
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

    return load_config(args.config, [
        f"warmup.steps={args.warmup_steps}", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.samples_per_prompt={args.group}", f"rollout.max_new_tokens={args.max_new_tokens}",
        "algorithm.estimator=grpo", "algorithm.estimator_params={}", "algorithm.dynamic_sampling=false",
        "algorithm.overlong.enable=false", f"optim.micro_batch_size={args.prompts * args.group}",
        "trainer.save_every=0", "trainer.eval_every=0", f"trainer.threads={args.threads}",
    ])


def warm_start(cfg, out: Path):
    """The embedded SFT warm-up, saved once: both trainers of every run start from it."""
    from hapo_openrlhf.local.model import save_hf
    from hapo_openrlhf.local.trainer import LocalTrainer

    t = LocalTrainer(cfg, out / "warm_run")
    t.run_warmup()
    save_hf(t.model, t.tok, out / "warm")
    problems = list(t.train_problems)
    t.close()
    return problems


def run_ours(cfg, out: Path, steps: int, run: int, rescore: bool = True) -> dict:
    """The embedded trainer from the warm model (no warm-up of its own), ``steps`` RL steps.
    ``rescore=False``: without the re-scoring forward after each update (``trainer.entropy_change_every:
    0``; the per-quadrant entropy change, a diagnostic TRL does not compute): the same work as TRL's step."""
    from dataclasses import replace

    from hapo_openrlhf.local.trainer import LocalTrainer

    c = replace(cfg, model=replace(cfg.model, path=str(out / "warm")), warmup=replace(cfg.warmup, steps=0),
                trainer=replace(cfg.trainer, entropy_change_every=1 if rescore else 0))
    t = LocalTrainer(c, out / f"ours_{run}_{'rescore' if rescore else 'same_work'}")
    t.verifier.warm()  # the math-verify worker's start-up before the timed steps, as TRL's (run_trl)
    rows, rewards = [], []
    for _ in range(steps):
        m = t.train_step()
        rows.append((m["response/tokens"], m["time/step_s"]))
        rewards.append(m["reward/mean"])
    t.close()
    return {"rows": rows, "rewards": rewards}


def run_trl(cfg, out: Path, steps: int, problems, run: int = 0) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hapo_openrlhf.data.templates import apply_template
    from hapo_openrlhf.data.tokenizer import load_tokenizer
    from hapo_openrlhf.rewards.verify import MathVerifier

    tok = load_tokenizer(out / "warm")
    model = AutoModelForCausalLM.from_pretrained(out / "warm", dtype=torch.float32)
    verifier = MathVerifier()
    verifier.warm()  # its worker's start-up (~1 s, once) in no timed step, as the embedded trainer's (run_ours)
    r = cfg.rollout

    rewards_seen: list[list[float]] = []

    def reward(prompts, completions, idx, **_):
        # the very answers the embedded trainer grades against (problems[i].answer: a tuple of accepted
        # forms), looked up by index: a dataset column holding str(answer) was "('20',)", which the
        # verifier never graded correct, so TRL trained on all-zero rewards (issue 60)
        out = verifier.score_batch(completions, [problems[i].answer for i in idx])
        rewards_seen.append(out)
        return out

    ds = Dataset.from_list([{"prompt": apply_template(cfg.data.template, p.problem), "idx": i}
                            for i, p in enumerate(problems)])

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
        output_dir=str(out / f"trl_{run}"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
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
    return {"rows": rows, "rewards": [sum(r) / len(r) for r in rewards_seen]}


def _summary(name: str, rows) -> dict:
    steady = rows[1:] or rows
    tok = sum(n for n, _ in steady)
    sec = sum(t for _, t in steady)
    return {"trainer": name, "steps_timed": len(steady), "tokens": tok, "seconds": sec, "tokens_per_s": tok / sec,
            "median_step_s": statistics.median(t for _, t in steady),
            "mean_response_len": tok / len(steady) / max(1, ARGS.prompts * ARGS.group)}


def constant(rewards: list[float]) -> bool:
    """Every step's mean reward the same (all 0: a trainer learning from nothing)."""
    return len(set(round(r, 12) for r in rewards)) <= 1


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(REPO / "configs" / "cpu_tiny.yaml"),
                    help="the run config whose model, task, template and sampling both trainers use (the embedded "
                         "default's; configs/cpu_tiny_chain.yaml: the leagues' testbed)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs of both trainers (ours, TRL, ours, ...)")
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
    try:
        cfg = _cfg(args)
    except ValueError as e:  # a missing or bad --config: named in one line
        sys.exit(f"benchmarks/vs_trl.py: {e}")
    ratios, ratios_rescore, per_run = [], [], []
    with tempfile.TemporaryDirectory() as d:
        out = Path(d)
        problems = warm_start(cfg, out)
        for run in range(args.runs):  # interleaved: drift on a noisy machine hits both trainers alike
            ours = run_ours(cfg, out, args.steps, run, rescore=False)
            theirs = run_trl(cfg, out, args.steps, problems, run)
            full = run_ours(cfg, out, args.steps, run, rescore=True)
            a = _summary("hapo-openrlhf (embedded, the same work as TRL's step)", ours["rows"])
            b = _summary(f"trl {trl.__version__} GRPOTrainer", theirs["rows"])
            c = _summary("hapo-openrlhf (embedded, + the re-scoring after each update)", full["rows"])
            if full["rewards"] != ours["rewards"]:  # the re-scoring is a no-grad forward: nothing else may move
                raise SystemExit(f"run {run + 1}: the embedded trainer's rewards differ with and without the "
                                 f"re-scoring: {full['rewards']} vs {ours['rewards']}")
            print(f"run {run + 1}: per-step reward, ours {[round(x, 3) for x in ours['rewards']]}; "
                  f"TRL {[round(x, 3) for x in theirs['rewards']]}", flush=True)
            bad = [n for n, r in (("ours", ours["rewards"]), ("TRL", theirs["rewards"])) if constant(r)]
            row = {"run": run + 1, "ours_tokens_per_s": a["tokens_per_s"], "trl_tokens_per_s": b["tokens_per_s"],
                   "ours_with_rescoring_tokens_per_s": c["tokens_per_s"],
                   "ours_rewards": ours["rewards"], "trl_rewards": theirs["rewards"],
                   "ours_mean_response_len": a["mean_response_len"], "trl_mean_response_len": b["mean_response_len"]}
            if bad:
                row["refused"] = f"{' and '.join(bad)} reward constant over the run: not the same work, no ratio"
                print(f"run {run + 1}: {row['refused']}", flush=True)
            else:
                row["ratio_ours_vs_trl"] = a["tokens_per_s"] / b["tokens_per_s"]
                row["ratio_with_rescoring_vs_trl"] = c["tokens_per_s"] / b["tokens_per_s"]
                ratios.append(row["ratio_ours_vs_trl"])
                ratios_rescore.append(row["ratio_with_rescoring_vs_trl"])
                print(f"run {run + 1}: ours {a['tokens_per_s']:.0f} tokens/s, TRL {b['tokens_per_s']:.0f} tokens/s: "
                      f"x{row['ratio_ours_vs_trl']:.2f} (ours with the re-scoring {c['tokens_per_s']:.0f} tokens/s: "
                      f"x{row['ratio_with_rescoring_vs_trl']:.2f})", flush=True)
            per_run.append(row)
    summary = {"runs": per_run, "steps": args.steps, "batch": args.prompts * args.group, "group": args.group,
               "ratios": ratios}
    if ratios:
        summary.update(median_ratio=statistics.median(ratios), min_ratio=min(ratios), max_ratio=max(ratios),
                       median_ratio_with_rescoring=statistics.median(ratios_rescore))
        print(f"median ratio over {len(ratios)} runs (the same work): x{summary['median_ratio']:.2f} "
              f"(range {min(ratios):.2f}-{max(ratios):.2f}); with the embedded trainer's re-scoring after each "
              f"update: x{summary['median_ratio_with_rescoring']:.2f} "
              f"(range {min(ratios_rescore):.2f}-{max(ratios_rescore):.2f})")
    else:
        summary["median_ratio"] = None
        print("no ratio: every run had a trainer with a constant reward")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
