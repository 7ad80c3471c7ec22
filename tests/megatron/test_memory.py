"""The Megatron actor's per-GPU memory arithmetic (megatron/memory.py): parameter counts equal
the Hugging Face models' own, Qwen3-30B-A3B's equals its published 30.5B (every part by hand),
and the per-rank split covers every parameter once."""

import pytest
import torch

from hapo_openrlhf.megatron.memory import GB, count_params, estimate

from .test_convert import tiny_config
from .test_moe import tiny_moe_config


def qwen3_30b_a3b():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False,
                          max_position_embeddings=40960)


@pytest.mark.parametrize("make", [lambda: tiny_config("qwen2", True), lambda: tiny_config("qwen3", False),
                                  lambda: tiny_config("llama", True), lambda: tiny_moe_config(),
                                  lambda: tiny_moe_config(tied=True)])
def test_parameter_counts_are_the_models_own(make):
    from transformers import AutoModelForCausalLM

    cfg = make()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert count_params(cfg).total == sum(p.numel() for p in model.parameters())


def test_qwen3_30b_a3b_by_hand():
    p = count_params(qwen3_30b_a3b())
    assert p.embedding == p.head == 151936 * 2048
    # q, o: 2048 x 32 x 128 each; k, v: 2048 x 4 x 128 each; 2 norms; QK-norm 2 x 128; router 128 x 2048
    assert p.dense_per_layer == 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 2048 + 2 * 128 + 128 * 2048 == 19_140_864
    assert p.experts_per_layer == 128 * 3 * 2048 * 768
    assert p.total == 30_532_122_624  # "30.5B" in Qwen's model card


def test_the_per_rank_split_covers_every_parameter_once():
    cfg = qwen3_30b_a3b()
    p = count_params(cfg)
    one = estimate(cfg, tokens=1024)
    for tp, pp, ep, dp in [(1, 1, 8, 8), (1, 2, 8, 8), (1, 4, 16, 16)]:
        e = estimate(cfg, tp=tp, pp=pp, ep=ep, dp=dp, tokens=1024)
        # the first stage's share: its layers' experts over EP and their dense part, and the embedding
        layers = p.layers // pp
        want = layers * (p.dense_per_layer + p.experts_per_layer // ep) + p.embedding + (p.head + 2048 if pp == 1 else 0)
        assert e["params_per_gpu_billion"] == pytest.approx(want / 1e9, rel=1e-3)  # vocabulary padding aside
        assert e["weights_gb"] == pytest.approx(2 * e["params_per_gpu_billion"] * 1e9 / GB)
        assert e["grads_gb"] == pytest.approx(2 * e["weights_gb"])
    assert one["optimizer_gb"] == pytest.approx(12 * one["params_per_gpu_billion"] * 1e9 / GB)
    whole = estimate(cfg, ep=8, dp=8, tokens=1024, distributed_optimizer=False)
    sharded = estimate(cfg, ep=8, dp=8, tokens=1024)
    # DP = EP: the experts have one expert-data-parallel rank (not sharded), the dense part 1/8
    assert whole["optimizer_gb"] == pytest.approx(6 * whole["weights_gb"]) and sharded["optimizer_gb"] < whole[
        "optimizer_gb"]
    # more data parallelism at the same EP shards only the optimizer state, over expert-DP as well
    wide = estimate(cfg, ep=8, dp=16, tokens=1024)
    assert wide["weights_gb"] == sharded["weights_gb"] and wide["optimizer_gb"] == pytest.approx(
        sharded["optimizer_gb"] / 2)
    with pytest.raises(ValueError, match="expert parallel size 8 must divide data parallel size 12"):
        estimate(cfg, ep=8, dp=12, tokens=1024)


def test_the_qwen3_30b_a3b_config_is_a_layout_the_arithmetic_fits():
    """configs/qwen3_30b_a3b_hapo_megatron.yaml (an extra): its TP x PP x EP x DP on its GPUs, at
    its token budget, fits 80 GB with the 3 GB reserve; the same model on one 8-GPU node does not."""
    from pathlib import Path

    from hapo_openrlhf.config import load_config
    from hapo_openrlhf.megatron.families import check_actor_family

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs/qwen3_30b_a3b_hapo_megatron.yaml")
    m, o = cfg.megatron, cfg.openrlhf
    world = o.actor_num_nodes * o.actor_gpus_per_node
    dp = world // m.model_parallel_size
    assert check_actor_family(qwen3_30b_a3b(), cfg.megatron).moe
    e = estimate(qwen3_30b_a3b(), tp=m.tensor_parallel, pp=m.pipeline_parallel, ep=m.expert_parallel, dp=dp,
                 tokens=o.max_tokens_per_gpu)
    assert (world, m.tensor_parallel, m.pipeline_parallel, m.expert_parallel, dp) == (16, 1, 1, 16, 16)
    assert e["total_gb"] + 3 <= 80 < estimate(qwen3_30b_a3b(), ep=8, dp=8, tokens=o.max_tokens_per_gpu)["total_gb"] + 3
