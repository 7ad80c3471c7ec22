"""TEST-ONLY stand-in for ``flash_attn.bert_padding`` (see flash_attn/__init__.py).

flash-attn's padding helpers are plain PyTorch index operations; these equivalents
let OpenRLHF's packed-sample layout (``unpad_and_slice_tensor`` /
``gather_and_pad_tensor``) run on CPU in the tests. The attention over the packed
row is then Hugging Face's SDPA with a block-diagonal mask derived from the
position ids, instead of flash-attn's varlen kernel.
"""

import torch
import torch.nn.functional as F
from einops import rearrange  # noqa: F401  (re-exported, as upstream does)


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return x[indices]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """[B, S, ...] -> ([nnz, ...], indices, cu_seqlens, max_seqlen, seqlens) over attended positions."""
    mask = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = mask.sum(-1, dtype=torch.int32)
    used = attention_mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, 0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max()), used


def pad_input(hidden_states, indices, batch, seqlen):
    """[nnz, ...] -> [B, S, ...] with zeros on the positions not in ``indices``."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])
