"""The final Hugging Face save from a gathered state dict (megatron/hf_save.py): the files
equal the state dict, tied and untied, and no second model is materialised -- counted by a
TorchDispatchMode over the save: no op allocates a tensor as large as the smallest weight
matrix (a from_config model would initialise every one). The memory itself:
benchmarks/final_save_memory.py."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, Qwen2Config

from hapo_openrlhf.megatron.hf_save import save_hf_state_dict


class LargestOutput(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_flatten(out)[0]:  # new storage only (views, aliases and detach share their input's)
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.numel())
        return out


def _config(tied):
    return Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [True, False])
def test_save_writes_the_state_dict_without_a_second_model(tmp_path, tied):
    cfg = _config(tied)
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    sd = {k: v.clone() for k, v in ref.state_dict().items() if not (tied and k == "lm_head.weight")}
    smallest_matrix = min(v.numel() for v in sd.values() if v.dim() == 2)
    with LargestOutput() as mode:
        save_hf_state_dict(sd, cfg, torch.bfloat16, tmp_path / "hf")
    assert mode.largest < smallest_matrix, mode.largest
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    for k, v in ref.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    assert (back.lm_head.weight.data_ptr() == back.model.embed_tokens.weight.data_ptr()) == tied
    ids = torch.randint(0, 300, (1, 9))
    assert torch.equal(ref(ids).logits, back(ids).logits)


@pytest.mark.parametrize("drop,add,match", [
    ("lm_head.weight", None, r"missing \['lm_head.weight'\]"),  # untied: the head is required
    ("model.norm.weight", None, r"missing \['model.norm.weight'\]"),
    (None, "model.layers.9.mlp.up_proj.weight", r"unexpected \['model.layers.9.mlp.up_proj.weight'\]"),
])
def test_a_conversion_mismatch_is_named_before_anything_is_written(tmp_path, drop, add, match):
    cfg = _config(False)
    sd = dict(AutoModelForCausalLM.from_config(cfg).state_dict())
    if drop:
        sd.pop(drop)
    if add:
        sd[add] = torch.zeros(2, 2)
    with pytest.raises(RuntimeError, match=match):
        save_hf_state_dict(sd, cfg, torch.float32, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def _tiny_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                          num_experts_per_tok=2, moe_intermediate_size=32, tie_word_embeddings=False)


def test_the_moe_final_save_writes_per_expert_tensors_without_stacking_them(tmp_path):
    """A Qwen3-MoE state dict in the checkpoint's per-expert names is written as it is: no op makes
    a tensor larger than one expert's matrix (transformers' fused [E, 2F, H] would be 8x that), and
    transformers reads the directory back to the same fused parameters and the same logits."""
    from hapo_openrlhf.megatron.moe import to_checkpoint_names

    cfg = _tiny_moe_config()
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    sd = {k: v.clone() for k, v in to_checkpoint_names(ref.state_dict(), cfg).items()}
    one_expert = 32 * 64
    with LargestOutput() as mode:
        save_hf_state_dict(sd, cfg, torch.bfloat16, tmp_path / "hf")
    assert mode.largest <= one_expert, mode.largest
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    for k, v in ref.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    ids = torch.randint(0, 300, (1, 9))
    assert torch.equal(ref(ids).logits, back(ids).logits)
    # a wrong shape or a missing expert is named before anything is written
    bad = dict(sd)
    bad["model.layers.1.mlp.experts.3.up_proj.weight"] = torch.zeros(31, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"shapes of \['model.layers.1.mlp.experts.3.up_proj.weight'\]"):
        save_hf_state_dict(bad, cfg, torch.bfloat16, tmp_path / "bad")
    bad.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    with pytest.raises(RuntimeError, match=r"missing \['model.layers.1.mlp.experts.3.up_proj.weight'\]"):
        save_hf_state_dict(bad, cfg, torch.bfloat16, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_the_moe_final_save_peaks_at_one_state_dict():
    """Peak resident memory over the save (VmHWM, benchmarks/final_save_memory.py --moe, a 70 MB
    Qwen3-MoE state dict): the per-expert save <= 1.2x the state dict; stacking the experts into
    transformers' fused parameters, as the save did before, > 1.8x."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "final_save_memory.py"
    ratios = {}
    for path in ("per_expert", "fused"):
        p = subprocess.run([sys.executable, str(script), "--child", path, "--hidden", "512", "--layers", "4",
                            "--vocab", "8000"], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        ratios[path] = json.loads(p.stdout.strip().splitlines()[-1])["ratio"]
    assert ratios["per_expert"] <= 1.2 < 1.8 < ratios["fused"], ratios
