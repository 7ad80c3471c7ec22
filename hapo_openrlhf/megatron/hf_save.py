"""Write a gathered Hugging Face state dict as a model directory, without a second model.

The Megatron actor's final save gathers the whole model into one state dict on rank 0's
host (``convert.gather_hf_state_dict``). Building a Hugging Face model from the config to
save it would allocate and randomly initialise a second full copy (about 2x the state dict
at peak, measured by ``benchmarks/final_save_memory.py``). Here the model is built on the
meta device and the state dict's tensors are assigned to it (``load_state_dict(...,
assign=True)``: no copy, no initialisation), so the peak is the state dict plus what
``save_pretrained`` buffers while writing.

A mixture of experts is written by :func:`save_moe_state_dict` instead: transformers 5.15 keeps
each layer's experts fused ([E, 2F, H] and [E, H, F]), so assigning the gathered per-expert tensors
would stack them -- the experts' size once more, about 2x the model at peak (~120 GB on rank 0's
host for Qwen3-30B-A3B). The checkpoint's own per-expert names are what vLLM and
``from_pretrained`` read, so the state dict is written as it is: safetensors shards (safetensors
writes from each tensor's memory, no copy) split by ``huggingface_hub``'s
``split_torch_state_dict_into_shards`` as ``save_pretrained`` splits them, the index, the config.
"""

from __future__ import annotations

from pathlib import Path

import torch


def save_hf_state_dict(sd: dict[str, torch.Tensor], hf_config, dtype: torch.dtype, out_dir: str | Path) -> None:
    """``save_pretrained`` of the model ``hf_config`` describes, holding ``sd``'s tensors.
    ``sd`` may leave out ``lm_head.weight`` only when the embeddings are tied; any other
    missing or unexpected key is an error naming it, before anything is written."""
    from transformers import AutoModelForCausalLM

    from .families import FAMILIES

    fam = FAMILIES.get(getattr(hf_config, "model_type", None))
    if fam is not None and fam.moe:  # the checkpoint's per-expert names, written as they are
        save_moe_state_dict(sd, hf_config, dtype, out_dir)
        return
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=True)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    bad_missing = [k for k in missing if not (k == "lm_head.weight" and tied)]
    if unexpected or bad_missing:
        raise RuntimeError(f"Megatron -> Hugging Face conversion mismatch: missing {bad_missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    if tied:
        hf.tie_weights()  # the head shares the assigned embedding
    still_meta = [n for n, p in hf.named_parameters() if p.is_meta]
    if still_meta:
        raise RuntimeError(f"Megatron -> Hugging Face conversion left parameters without values: {still_meta[:5]}")
    hf.save_pretrained(out_dir)


def save_moe_state_dict(sd: dict[str, torch.Tensor], hf_config, dtype: torch.dtype, out_dir: str | Path,
                        max_shard_size: str | int = "5GB") -> None:
    """A mixture-of-experts model directory from ``sd`` in the checkpoint's per-expert names
    (``convert.hf_shapes``; ``lm_head.weight`` left out only when tied), with no copy of any
    tensor: every name and shape is checked against the config before anything is written."""
    import copy
    import json

    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from .convert import hf_shapes

    want = hf_shapes(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    if tied:
        want.pop("lm_head.weight", None)
    missing = [k for k in want if k not in sd]
    unexpected = [k for k in sd if k not in want]
    if missing or unexpected:
        raise RuntimeError(f"Megatron -> Hugging Face conversion mismatch: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    shape = [k for k, v in sd.items() if tuple(v.shape) != tuple(want[k])]
    if shape:
        raise RuntimeError(f"Megatron -> Hugging Face conversion mismatch: shapes of {shape[:5]} differ from the "
                           f"config's ({[tuple(want[k]) for k in shape[:5]]})")
    wrong = [k for k, v in sd.items() if v.dtype != dtype]
    if wrong:
        raise RuntimeError(f"Megatron -> Hugging Face conversion: {wrong[:5]} are not {dtype}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    split = split_torch_state_dict_into_shards(sd, max_shard_size=max_shard_size)
    for name, keys in split.filename_to_tensors.items():
        save_file({k: sd[k].contiguous() for k in keys}, str(out / name), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
                 "weight_map": split.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    cfg = copy.deepcopy(hf_config)
    cfg.dtype = dtype
    cfg.save_pretrained(out)
    GenerationConfig.from_model_config(cfg).save_pretrained(out)
