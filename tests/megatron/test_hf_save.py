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
