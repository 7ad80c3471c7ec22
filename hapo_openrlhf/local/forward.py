"""The embedded trainer's scoring and training forwards over a rollout (``generation.Rollout``):
log-probs and entropy per response token, the fused head's chunked loss, the nucleus signals.

Shape legend: B sequences, P prompt tokens (left padded), R response tokens
(right padded), L = P + R.
"""

from __future__ import annotations

import torch

from ..algos import check_finite, logprobs_and_entropy
from ..algos.fused import fused_logprobs_entropy, fused_token_loss
from ..algos.nucleus import sharded_nucleus_logmass, sharded_nucleus_stats
from ..generation.decoder import Decoder, unsupported
from ..generation.rollout import Rollout


def _hidden_states(model, seq_BL, attn_BL, packing: bool, prompt_len: int | None = None) -> torch.Tensor:
    """Last hidden states [B, L, H] of the decoder (before the LM head); padding positions
    carry no meaning (0, or whatever transformers computes there).

    Qwen2 / Qwen3 / Llama without ``packing``: ``decoder.Decoder``'s forward (the projections
    on the real tokens only). Other architectures: transformers' forward over the padded batch.

    packing: drop the padding and run the rows as one [1, sum(len)] sequence whose
    position ids restart at 0 for every row. Hugging Face attention detects the
    boundaries from the position ids: SDPA/eager build a block-diagonal causal mask,
    flash-attention 2 runs its varlen kernel (cu_seqlens), so no row attends to
    another and no compute is spent on padding. Results are scattered back to the
    padded [B, L] layout (zeros on padding).
    """
    decoder = model.get_decoder()
    if not packing and unsupported(model) is None:
        # the projections and MLPs on the real tokens only (decoder.py): transformers' forward within
        # float tolerance, without arithmetic on padding
        return Decoder(model).forward(seq_BL, attn_BL, prompt_len=prompt_len)  # a group's prompt runs once
    if not packing:  # another architecture: transformers' padded forward
        pos = (attn_BL.cumsum(-1) - 1).clamp(min=0)
        return decoder(input_ids=seq_BL, attention_mask=attn_BL, position_ids=pos, use_cache=False).last_hidden_state
    keep = attn_BL.bool()
    lens = keep.sum(-1)
    if bool((lens == 0).any()):
        raise ValueError("packing: a row has no attended token")
    pos = torch.cat([torch.arange(int(n), device=seq_BL.device) for n in lens]).unsqueeze(0)
    packed = decoder(input_ids=seq_BL[keep].unsqueeze(0), attention_mask=None, position_ids=pos,
                     use_cache=False).last_hidden_state[0]
    out = packed.new_zeros(*seq_BL.shape, packed.shape[-1])
    out[keep] = packed  # boolean indexing is row-major: the same order as the packing
    return out


def _response_hidden(model, rollout: Rollout, packing: bool) -> torch.Tensor:
    """Hidden states [B, R, H] that predict the response tokens: the state at t predicts
    token t+1, so the response is predicted from positions P-1 .. L-2."""
    P = rollout.prompt_len
    return _hidden_states(model, rollout.sequences_BL, rollout.attention_mask_BL, packing, P)[:, P - 1 : -1]


def _fused_head_weight(model) -> torch.Tensor:
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("fused LM head: the output layer has a bias (set model.fused_head: false)")
    return head.weight


def fused_policy_loss(model, rollout: Rollout, loss_of, *, temperature: float, chunk_size: int,
                      packing: bool = False):
    """(loss, log-probs [B,R], entropy [B,R]) with the loss's gradient computed inside the
    fused head's forward (``fused_token_loss``), chunks of whole rows.

    ``loss_of(logp_kR, ent_kR, rows: slice)`` returns the loss of rows ``rows`` (already
    masked like ``policy_forward``'s outputs, normalised by the global normaliser); the
    loss must be row-local (registered ``row_local``). Log-probs and entropy
    come back detached and masked, for metrics.
    """
    mask = rollout.response_mask_BR
    R = mask.shape[1]
    m = mask.float()

    def token_loss(lp, en, sl):
        rows = slice(sl.start // R, sl.stop // R)
        lp, en = lp.view(-1, R), en.view(-1, R)
        check_finite("log-probs", lp.detach(), mask[rows])
        return loss_of(lp * m[rows], en * m[rows], rows)

    loss, logp, ent = fused_token_loss(_response_hidden(model, rollout, packing), _fused_head_weight(model),
                                       rollout.response_ids_BR, token_loss, temperature=temperature,
                                       chunk_size=max(1, chunk_size // R) * R)
    return loss, logp * mask, ent * mask


def policy_forward(model, rollout: Rollout, *, temperature: float, chunk_size: int, with_entropy_grad: bool = False,
                   fused: bool = True, packing: bool = False, nucleus_top_p: float | None = None,
                   signals_top_p: float | None = None):
    """(log-probs [B,R], entropy [B,R]) of the response tokens under ``model`` at
    ``temperature``; entropy is detached unless ``with_entropy_grad``. With
    ``nucleus_top_p`` a third tensor: log P(top-p nucleus) [B,R] of each response
    position's full distribution (``rollout/nucleus_logmass``; no grad, 0 at top-p 1). With
    ``signals_top_p`` two more, detached: the entropy over the top-p nucleus and the top-two
    log-prob gap [B,R] (PAEC's signals, ``algos.nucleus.sharded_nucleus_stats``).

    fused: the LM head, log-prob and entropy run chunk by chunk from the hidden
    states (``fused_logprobs_entropy``), so the [B, R, V] logits never exist; else
    the LM head builds the response positions' logits, reduced chunk by chunk.
    """
    mask, labels = rollout.response_mask_BR, rollout.response_ids_BR
    hid = _response_hidden(model, rollout, packing)
    if fused:
        head = _fused_head_weight(model)
        logp, ent = fused_logprobs_entropy(hid, head, labels, temperature=temperature, chunk_size=chunk_size)
        check_finite("log-probs", logp.detach(), mask)
        if nucleus_top_p is not None:
            logmass = sharded_nucleus_logmass(hid, nucleus_top_p, weight=head, temperature=temperature,
                                              chunk_size=chunk_size)
        if signals_top_p is not None:
            sig = sharded_nucleus_stats(hid.detach(), signals_top_p, weight=head.detach(), temperature=temperature,
                                        chunk_size=chunk_size, entropy=True, top2_gap=True)
    else:
        resp_logits = model.get_output_embeddings()(hid)
        check_finite("logits", resp_logits.detach().amax(-1), mask)
        logp, ent = logprobs_and_entropy(resp_logits, labels, chunk_size, temperature)
        if nucleus_top_p is not None:
            logmass = sharded_nucleus_logmass(resp_logits, nucleus_top_p, temperature=temperature,
                                              chunk_size=chunk_size)
        if signals_top_p is not None:
            sig = sharded_nucleus_stats(resp_logits.detach(), signals_top_p, temperature=temperature,
                                        chunk_size=chunk_size, entropy=True, top2_gap=True)
    if not with_entropy_grad:
        ent = ent.detach()
    out = (logp * mask, ent * mask)
    if nucleus_top_p is not None:
        out += (logmass * mask,)
    if signals_top_p is not None:
        out += (sig.entropy * mask, torch.where(mask.bool(), sig.top2_gap, torch.zeros_like(sig.top2_gap)))
    return out
