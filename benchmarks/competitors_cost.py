"""What each competitor estimator (SPEC 2.8) adds to a training step, as a ratio to GRPO
measured in the same run (this CPU, 2 threads unless ``--threads``).

On the embedded trainer's real batches (a few GRPO steps after a short warm-up; first step
skipped) it times the advantage computation of ``grpo``, ``hapo``, ``eapo_entropic`` and
``pepo`` and ``less`` (best of ``--repeat``), and reports each one's time over GRPO's and its extra time
as a fraction of the measured step. The loss-side methods (``stare``, ``rsi_s``, ``paec``) are
timed as their loss's forward + backward over the same batch, as a ratio to the host loss (``ppo``,
dual clip). The same estimators on a synthetic paper-scale batch (``--rows`` x ``--tokens``) show
how the cost scales (there is no CPU step time for that). PAEC's head signals (nucleus entropy and
top-two gap, ``sharded_nucleus_stats`` from hidden states + LM head, ``--head-tokens`` x
``--hidden`` x ``--vocab``) are timed as a ratio to the fused head's log-prob + entropy forward
on the same rows (``fused_logprobs_entropy``): the extra head pass a PAEC step pays, at each
``--vocab``, on rows like a trained model's (``_embedded.peaked_hidden``; today's path and every
row sorted, the path before issue 61) and on flat N(0, 1) logits (the worst case). LESS's
full-scan matcher from before issue 61 (the tests' oracle) is timed on the paper-scale batch in
the same run, and its advantages compared with the tensor matcher's.

    python benchmarks/competitors_cost.py [--steps 3 --repeat 10 --rows 256 --tokens 4096]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from hapo_openrlhf import algos

from _args import add_threads_argument  # benchmarks/_args.py (the script's own folder is on sys.path)
from _embedded import best_of, grpo_step_batches, peaked_hidden  # benchmarks/_embedded.py (the script's own folder is on sys.path)

METHODS = {"grpo": {}, "hapo": {"alpha": 0.2, "phi": 2.0}, "eapo_entropic": {}, "pepo": {}, "less": {}}
# label -> (registry loss, params); rsi_s's bounds are ours (the paper publishes none)
LOSS_METHODS = {"ppo": ("ppo", {"eps_high": 0.28, "dual_clip": 10.0}), "stare": ("stare", {}),
                "stare_c2": ("stare", {"variant": "C2"}), "rsi_s": ("rsi_s", {"lower": 0.2, "upper": 5.0}),
                # paec's unpublished values are ours; a floor above the masked entropy, so the penalty acts
                "paec": ("paec", {"beta": 1.0, "rho_min": 0.5, "top_p": 0.9, "mask": "product", "softness": 0.0,
                                  "loss_state": {"h_low": 5.0}})}


def _loss_times(mask: torch.Tensor, repeat: int) -> dict[str, float]:
    """Forward + backward of each loss on [B, T] log-probs (the policy's part excluded)."""
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(mask.shape, generator=g) * 3
    adv = torch.randn(mask.shape[0], 1, generator=g).expand(mask.shape).contiguous()
    logp = (old + 0.01 * torch.randn(mask.shape, generator=g)).requires_grad_(True)
    # the current entropy (rsi_s's index; paec's H_bar, with its gradient) and paec's head signals
    entropy = (torch.rand(mask.shape, generator=g) * 2 + 0.05).requires_grad_(True)
    signals = dict(nucleus_entropy=torch.rand(mask.shape, generator=g), top2_gap=torch.rand(mask.shape, generator=g) * 3)

    def run(name, params):
        extra = signals if name == "paec" else {}
        loss, _ = algos.compute_policy_loss(name, logp, old, adv, mask, entropy=entropy, **extra, **params)
        loss.backward()

    return {m: best_of(lambda n=n, p=p: run(n, p), repeat) for m, (n, p) in LOSS_METHODS.items()}


def _head_signal_times(n: int, hidden: int, vocab: int, repeat: int) -> dict[str, float]:
    """The fused head's log-probs + entropy forward vs PAEC's signal pass on the same rows: on rows
    like a trained model's (``peaked_hidden``), today's path and every row sorted (before issue 61);
    on flat N(0, 1) logits (every nucleus most of the vocabulary: every row falls to the sort)."""
    from hapo_openrlhf.algos.fused import fused_logprobs_entropy
    from hapo_openrlhf.algos.nucleus import sharded_nucleus_stats

    g = torch.Generator().manual_seed(2)
    flat, w = torch.randn(n, hidden, generator=g), torch.randn(vocab, hidden, generator=g) / hidden ** 0.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    peaked = peaked_hidden(flat, w, g)

    def signals(x, **kw):
        return lambda: sharded_nucleus_stats(x, 0.9, weight=w, chunk_size=1024, entropy=True, top2_gap=True, **kw)

    with torch.no_grad():
        return {"head": best_of(lambda: fused_logprobs_entropy(peaked, w, labels, chunk_size=1024), repeat),
                "signals": best_of(signals(peaked), repeat), "signals_sorted": best_of(signals(peaked, top_k=0), repeat),
                "flat_head": best_of(lambda: fused_logprobs_entropy(flat, w, labels, chunk_size=1024), repeat),
                "flat_signals": best_of(signals(flat), repeat)}


def _times(inputs, repeat: int) -> dict[str, float]:
    return {m: best_of(lambda m=m: algos.run_estimator(m, inputs, **p), repeat) for m, p in METHODS.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=50, help="supervised warm-up steps before the measured RL steps")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--head-tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    add_threads_argument(ap)
    a = ap.parse_args()
    steps = []
    for inputs, step_s in grpo_step_batches(a.steps, a.warmup, a.threads):
        steps.append(step_s)
    emb = _times(inputs, a.repeat)
    step_s = sum(steps) / len(steps)
    B, T = inputs.response_mask.shape
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(a.tokens // 4, a.tokens + 1, (a.rows,), generator=g)
    mask = torch.arange(a.tokens)[None, :] < lens[:, None]
    rewards = (torch.rand(a.rows, generator=g) > 0.5).float()
    big = algos.AdvantageInputs(rewards=rewards, response_mask=mask, entropy=torch.rand(a.rows, a.tokens, generator=g),
                                group_index=torch.arange(a.rows) // 8, correct=rewards > 0.5,
                                # a small vocabulary, so that LESS finds shared segments to cluster
                                response_ids=torch.randint(0, 4, (a.rows, a.tokens), generator=g))
    paper = _times(big, max(2, a.repeat // 5))
    out = {"embedded_batch": [B, T], "embedded_step_ms": step_s * 1e3, "paper_batch": [a.rows, a.tokens],
           "threads": a.threads}
    print(f"{'method':15s} {'embedded ms':>12s} {'x grpo':>8s} {'% of step':>10s} {'paper-scale ms':>15s} {'x grpo':>8s}")
    for m in METHODS:
        row = {"embedded_ms": emb[m] * 1e3, "embedded_ratio": emb[m] / emb["grpo"],
               "extra_pct_of_step": 100 * (emb[m] - emb["grpo"]) / step_s,
               "paper_ms": paper[m] * 1e3, "paper_ratio": paper[m] / paper["grpo"]}
        out[m] = row
        print(f"{m:15s} {row['embedded_ms']:12.3f} {row['embedded_ratio']:8.2f} {row['extra_pct_of_step']:10.3f} "
              f"{row['paper_ms']:15.1f} {row['paper_ratio']:8.2f}")
    el, pl = _loss_times(inputs.response_mask, a.repeat), _loss_times(mask, max(2, a.repeat // 5))
    for m in LOSS_METHODS:
        row = {"embedded_ms": el[m] * 1e3, "embedded_ratio": el[m] / el["ppo"],
               "extra_pct_of_step": 100 * (el[m] - el["ppo"]) / step_s, "paper_ms": pl[m] * 1e3,
               "paper_ratio": pl[m] / pl["ppo"]}
        out[f"loss_{m}"] = row
        print(f"loss {m:10s} {row['embedded_ms']:12.3f} {row['embedded_ratio']:8.2f} {row['extra_pct_of_step']:10.3f} "
              f"{row['paper_ms']:15.1f} {row['paper_ratio']:8.2f}   (x ppo)")
    # LESS's matcher before issue 61 (every scan in full: tests/algos/less_reference.py, the tests' oracle),
    # on the same paper-scale batch in this run, and the two results compared
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for the tests' oracle
    from tests.algos.less_reference import less_reference

    ref_s = best_of(lambda: less_reference(big), 1)
    same = torch.equal(less_reference(big).advantages, algos.run_estimator("less", big).advantages)
    out["less_full_scan"] = {"paper_ms": ref_s * 1e3, "tensor_over_full_scan": paper["less"] / ref_s, "equal": same}
    print(f"less, the full scan before issue 61: {ref_s * 1e3:.1f} ms at paper scale; the tensor matcher "
          f"{paper['less'] * 1e3:.1f} ms = {paper['less'] / ref_s:.3f} x it; advantages equal: {same}")
    out["paec_head_signals"] = {}
    for V in a.vocab:
        hs = _head_signal_times(a.head_tokens, a.hidden, V, max(2, a.repeat // 5))
        row = {"head_ms": hs["head"] * 1e3, "signals_ms": hs["signals"] * 1e3,
               "ratio_to_head": hs["signals"] / hs["head"], "sorted_ratio_to_head": hs["signals_sorted"] / hs["head"],
               "flat_ratio_to_head": hs["flat_signals"] / hs["flat_head"], "shape": [a.head_tokens, a.hidden, V]}
        out["paec_head_signals"][str(V)] = row
        print(f"paec head signals ({a.head_tokens} x {a.hidden} x {V}), rows like a trained model's: "
              f"{row['signals_ms']:.1f} ms = {row['ratio_to_head']:.2f} x the fused head's log-prob + entropy forward "
              f"({row['head_ms']:.1f} ms); every row sorted (before issue 61) {row['sorted_ratio_to_head']:.2f} x; "
              f"flat N(0, 1) logits (every row sorted either way) {row['flat_ratio_to_head']:.2f} x")
    print(f"embedded step ({B} samples x {T} tokens): {step_s * 1e3:.1f} ms")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
