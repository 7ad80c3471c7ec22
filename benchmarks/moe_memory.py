"""Per-GPU memory of the Megatron actor for Qwen3-30B-A3B at 24k tokens per micro-batch, by layout
(megatron/memory.py: arithmetic of what the actor allocates by design, not a measurement -- no GPU
here). Prints a markdown table; docs/megatron.md ("Mixture of experts") holds its output.

    python benchmarks/moe_memory.py [--tokens 24576] [--gpu-gb 80]
"""

import argparse

from transformers import Qwen3MoeConfig

from hapo_openrlhf.megatron.memory import estimate

# TP x PP x EP x DP; TP > 1 needs sequence parallelism with MoE (the TE spec); PP > 1 with EP > 1 is
# refused by the config loader (megatron-core's rank-order assertion; docs/megatron.md): shown, marked
LAYOUTS = [(1, 1, 8, 8), (1, 1, 8, 16), (1, 1, 16, 16), (1, 2, 8, 8), (1, 2, 16, 16), (1, 4, 8, 8),
           (1, 1, 32, 32), (2, 1, 8, 8), (2, 2, 8, 8)]
RESERVE_GB = 3.0  # CUDA context, NCCL buffers, fragmentation (left out of the arithmetic)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=24576)
    ap.add_argument("--gpu-gb", type=float, default=80.0)
    args = ap.parse_args()
    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
                         max_position_embeddings=40960)
    print("| TP x PP x EP x DP | GPUs | params / GPU | weights | grads | optimizer | activations | total GB | "
          f"fits {args.gpu_gb:.0f} GB (with {RESERVE_GB:.0f} GB reserve) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tp, pp, ep, dp in LAYOUTS:
        e = estimate(cfg, tp=tp, pp=pp, ep=ep, dp=dp, tokens=args.tokens, sequence_parallel=tp > 1)
        fits = e["total_gb"] + RESERVE_GB <= args.gpu_gb
        note = " (TE spec + sequence parallelism)" if tp > 1 else ""
        if pp > 1 and ep > 1:
            note += " -- refused: PP > 1 with EP > 1"
        print(f"| {tp} x {pp} x {ep} x {dp} | {tp * pp * dp} | {e['params_per_gpu_billion']:.2f}B | "
              f"{e['weights_gb']:.1f} | {e['grads_gb']:.1f} | {e['optimizer_gb']:.1f} | {e['activations_gb']:.1f} | "
              f"{e['total_gb']:.1f} | {'yes' if fits else 'no'}{note} |")


if __name__ == "__main__":
    main()
