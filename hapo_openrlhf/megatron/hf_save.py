"""Write a gathered Hugging Face state dict as a model directory, without a second model.

The Megatron actor's final save gathers the whole model into one state dict on rank 0's
host (``convert.gather_hf_state_dict``). Building a Hugging Face model from the config to
save it would allocate and randomly initialise a second full copy (about 2x the state dict
at peak, measured by ``benchmarks/final_save_memory.py``). Here the model is built on the
meta device and the state dict's tensors are assigned to it (``load_state_dict(...,
assign=True)``: no copy, no initialisation), so the peak is the state dict plus what
``save_pretrained`` buffers while writing.
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
    if fam is not None and fam.moe:  # the stream's per-expert names -> transformers' fused parameters
        from .moe import to_fused_names

        sd = to_fused_names(sd, hf_config)  # stacks each layer's experts: their size once more at peak
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
