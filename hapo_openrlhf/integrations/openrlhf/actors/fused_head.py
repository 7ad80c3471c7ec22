"""OpenRLHF's ``Actor.forward`` with hapo's fused LM head (no [T, V] logits).

Upstream's forward runs the whole causal LM, casts the [B, T, V] logits to fp32,
divides them by the temperature and reduces them (and, with ``return_entropy``,
builds the full softmax a second time). :func:`install_fused_head` replaces the
forward of one ``openrlhf.models.Actor`` instance with one that has the same
signature and return contract but

* runs the model with ``logits_to_keep`` = an empty index tensor (Hugging Face
  computes the LM head on zero positions) and captures the decoder's last hidden
  state with a forward hook, so the DeepSpeed engine's own forward still runs;
* computes the log-prob of each next token and the entropy at the actor's
  temperature with :func:`hapo_openrlhf.algos.fused.fused_logprobs_entropy`,
  chunk by chunk over tokens, gradients through both;
* passes ``use_cache=False`` (as upstream's loader sets in the config): with a
  KV cache Hugging Face would not detect the packed rows' boundaries;
* keeps upstream's packing / ring-attention layout (``unpad_and_slice_tensor`` /
  ``gather_and_pad_tensor``) and its ``[:, :-1]`` shift, so log-probs and entropy
  come back exactly where upstream puts them;
* under a top-p rollout, no-grad passes (the old log-probs) also set
  ``output.nucleus_logmass``, log P(nucleus) per position from the same hidden states
  (:func:`hapo_openrlhf.algos.nucleus.sharded_nucleus_logmass`, one more matmul a chunk);
* with ``actor._hapo_signals_top_p`` set (a loss that takes them: PAEC), training passes
  also set ``output.nucleus_entropy`` and ``output.top2_gap``, detached, from the same
  hidden states (``sharded_nucleus_stats``, one more matmul a chunk).

Calls the fused path cannot serve fall through to upstream's forward unchanged:
a caller that wants the logits themselves (``action_mask is None`` and no
``return_logprobs``), and multimodal inputs. Models the fused path cannot serve
at all are refused up front by :func:`fused_head_unsupported` (the actor then
keeps upstream's forward, and the reason is logged): ZeRO-3 (the LM-head weight
is partitioned and only gathered inside the head's own forward), an LM head that
is not a plain bias-free ``nn.Linear`` (LoRA on the head, a bias), MoE models that
return router logits (the aux loss needs them), VLMs.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
from openrlhf.models.ring_attn_utils import gather_and_pad_tensor, unpad_and_slice_tensor

from ....algos.fused import fused_logprobs_entropy
from ....algos.nucleus import sharded_nucleus_logmass, sharded_nucleus_stats


def _hf_model(actor) -> torch.nn.Module:
    """The Hugging Face model under ``actor.model`` (a DeepSpeed engine after ``strategy.prepare``)."""
    m = actor.model
    return getattr(m, "module", m)


def fused_head_unsupported(actor) -> Optional[str]:
    """Why the fused head cannot replace ``actor``'s LM head, or None when it can."""
    if getattr(actor, "is_vlm", False):
        return "vision-language models keep OpenRLHF's head"
    hf = _hf_model(actor)
    head = hf.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"the output layer is {type(head).__name__}, not a plain nn.Linear (LoRA on the LM head?)"
    if head.bias is not None:
        return "the output layer has a bias"
    if hasattr(head.weight, "ds_id"):
        return "ZeRO-3 partitions the LM-head weight (it is only gathered inside the head's forward)"
    if getattr(hf.config, "output_router_logits", False):
        return "MoE router logits (aux loss) need the full forward"
    if getattr(hf.config, "final_logit_softcapping", None):
        return "logit soft-capping is not part of the fused head"
    return None


def _nucleus_extras(self, hidden: torch.Tensor, head_weight: torch.Tensor, return_output: bool):
    """What the head computes beside log-probs and entropy, from the same hidden states: log P(nucleus)
    per position on the old-log-prob pass under top-p (``rollout/nucleus_logmass``), and on the
    training passes of a loss that takes them (PAEC) the nucleus entropy and top-two gap, detached."""
    top_p = getattr(self, "_hapo_nucleus_top_p", 1.0)
    # the old-log-prob pass under top-p: log P(nucleus) per position, for rollout/nucleus_logmass
    logmass = None
    if return_output and top_p < 1.0 and not torch.is_grad_enabled():
        logmass = sharded_nucleus_logmass(hidden, top_p, weight=head_weight, temperature=self.temperature,
                                          chunk_size=self._hapo_fused_chunk)
    # training passes of a loss that takes them (PAEC): the nucleus entropy and top-two gap, detached
    signals = None
    signals_top_p = getattr(self, "_hapo_signals_top_p", None)
    if return_output and signals_top_p is not None and torch.is_grad_enabled():
        st = sharded_nucleus_stats(hidden.detach(), signals_top_p, weight=head_weight.detach(),
                                   temperature=self.temperature, chunk_size=self._hapo_fused_chunk,
                                   entropy=True, top2_gap=True)
        signals = (st.entropy, st.top2_gap)
    return logmass, signals


def _fused_forward(
    self,
    sequences: torch.LongTensor,
    action_mask: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    return_output=False,
    allgather_logits=False,
    return_logprobs=False,
    ring_attn_group=None,
    packed_seq_lens=None,
    return_entropy=False,
    **mm_inputs,
):
    if (action_mask is None and not return_logprobs) or mm_inputs:
        return self._hapo_upstream_forward(
            sequences, action_mask, attention_mask, return_output, allgather_logits, return_logprobs,
            ring_attn_group, packed_seq_lens, return_entropy, **mm_inputs,
        )
    batch, seqlen = sequences.size()
    if self.packing_samples:
        sequences, position_ids, rolled_sequences, ring_attn_pad_len, indices = unpad_and_slice_tensor(
            sequences, attention_mask, ring_attn_group
        )
        forward_attention_mask = None
    else:
        rolled_sequences = torch.roll(sequences, shifts=-1, dims=1)
        forward_attention_mask = attention_mask
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)

    hf = _hf_model(self)
    captured = {}

    def grab(module, args, out):
        captured["h"] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    hook = hf.get_decoder().register_forward_hook(grab)
    try:
        no_logits = torch.empty(0, dtype=torch.long, device=sequences.device)
        output = self.model(sequences, attention_mask=forward_attention_mask, position_ids=position_ids,
                            logits_to_keep=no_logits, use_cache=False)
    finally:
        hook.remove()
    hidden, head_weight = captured.pop("h"), hf.get_output_embeddings().weight
    log_probs, entropy = fused_logprobs_entropy(
        hidden, head_weight, rolled_sequences, temperature=self.temperature, chunk_size=self._hapo_fused_chunk,
    )
    logmass, signals = _nucleus_extras(self, hidden, head_weight, return_output)
    del hidden
    if self.packing_samples:
        log_probs = gather_and_pad_tensor(log_probs, ring_attn_group, ring_attn_pad_len, indices, batch, seqlen)
        if return_entropy:
            entropy = gather_and_pad_tensor(entropy, ring_attn_group, ring_attn_pad_len, indices, batch, seqlen)
        if logmass is not None:
            logmass = gather_and_pad_tensor(logmass, ring_attn_group, ring_attn_pad_len, indices, batch, seqlen)
        if signals is not None:
            signals = tuple(gather_and_pad_tensor(t, ring_attn_group, ring_attn_pad_len, indices, batch, seqlen)
                            for t in signals)
    output["logits"] = None  # never built; upstream callers of this path read log-probs and entropy only
    if return_entropy:
        assert return_output
        setattr(output, "entropy", entropy[:, :-1])
    if logmass is not None:
        setattr(output, "nucleus_logmass", logmass[:, :-1])
    if signals is not None:
        setattr(output, "nucleus_entropy", signals[0][:, :-1])
        setattr(output, "top2_gap", signals[1][:, :-1])
    log_probs = log_probs[:, :-1]
    if action_mask is None:  # return_logprobs
        return (log_probs, output) if return_output else log_probs
    action_log_probs = log_probs[:, -action_mask.shape[1] :] * action_mask.float()
    return (action_log_probs, output) if return_output else action_log_probs


def install_fused_head(actor, chunk_size: int, top_p: float = 1.0) -> Optional[str]:
    """Swap ``actor``'s forward for the fused one; returns why not (upstream's forward kept), or None.
    ``top_p`` < 1 (the rollout's): no-grad passes also set ``output.nucleus_logmass`` [B, S-1]."""
    reason = fused_head_unsupported(actor)
    if reason is not None:
        return reason
    actor._hapo_upstream_forward = actor.forward
    actor._hapo_fused_chunk = int(chunk_size)
    actor._hapo_nucleus_top_p = float(top_p)
    actor.forward = types.MethodType(_fused_forward, actor)
    return None
