"""Sampling and scoring forwards for the embedded trainer (``sampler.KVSampler``: Hugging Face
``generate``'s sampling rule, its log-probs and entropy recorded as it draws).

Shape legend: B sequences, P prompt tokens (left padded), R response tokens
(right padded), L = P + R.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..algos import check_finite, logprobs_and_entropy
from ..algos.fused import fused_logprobs_entropy, fused_token_loss
from ..algos.nucleus import sharded_nucleus_logmass, sharded_nucleus_stats
from .decoder import Decoder, unsupported
from .sampler import KVSampler


@dataclass
class Rollout:
    sequences_BL: torch.Tensor  # prompt (left-padded) + response (right-padded)
    attention_mask_BL: torch.Tensor
    response_mask_BR: torch.Tensor  # 1 on generated tokens up to and including EOS
    prompt_len: int
    responses: list[str]
    truncated_B: torch.Tensor  # bool: hit max_new_tokens without EOS
    # the sampler's log p_T, entropy of p_T and log p_T(top-p set) per response token (0 off
    # the mask); None when the rollout came from transformers' generate (another architecture)
    logprobs_BR: torch.Tensor | None = None
    entropy_BR: torch.Tensor | None = None
    logmass_BR: torch.Tensor | None = None

    @property
    def response_ids_BR(self) -> torch.Tensor:
        return self.sequences_BL[:, self.prompt_len :]

    def select(self, idx: list[int]) -> "Rollout":
        i = torch.as_tensor(idx, dtype=torch.long)
        pick = lambda t: None if t is None else t[i]  # noqa: E731
        return Rollout(
            self.sequences_BL[i], self.attention_mask_BL[i], self.response_mask_BR[i],
            self.prompt_len, [self.responses[j] for j in idx], self.truncated_B[i],
            pick(self.logprobs_BR), pick(self.entropy_BR), pick(self.logmass_BR),
        )


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], *, n: int, temperature: float, top_p: float,
             max_new_tokens: int, check_positions: bool = False) -> Rollout:
    """Sample ``n`` responses per prompt; rows are grouped: prompt j -> rows [j*n, (j+1)*n).
    Qwen2 / Qwen3 / Llama models sample through ``KVSampler`` (``generate``'s sampling rule,
    with the log-probs and entropy of what it drew), others through ``generate``."""

    # each prompt is tokenized once; its n rows are copies (the same ids and padding as
    # tokenizing the expanded list), so the position check costs nothing extra
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    limit = getattr(model.config, "max_position_embeddings", None) if check_positions else None
    if limit:  # checked before generation allocates anything: a 1 MB prompt is an error, not a 1 TB buffer
        for j, n_tok in enumerate(enc.attention_mask.sum(-1).tolist()):
            if n_tok + max_new_tokens > limit:
                raise ValueError(f"prompt {j} ({prompts[j][:60]!r}...) has {n_tok} tokens; with max_new_tokens "
                                 f"{max_new_tokens} it exceeds the model's {limit} positions "
                                 f"(model.max_position_embeddings): shorten or drop it")
    was_training = model.training
    model.eval()
    scores, rows = None, {k: v.repeat_interleave(n, dim=0) for k, v in enc.items()}
    if KVSampler.unsupported(model) is None:  # generate's rule without its per-step machinery (sampler.py)
        s = KVSampler(model).sample(enc["input_ids"], enc["attention_mask"], temperature=temperature, top_p=top_p,
                                    max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id, repeats=n)
        out, scores = s.sequences, (s.logprobs, s.entropy, s.nucleus_logmass)
    else:  # another architecture (hapo eval --engine hf on any Hugging Face model): transformers' generate
        from transformers import GenerationConfig

        gen_cfg = GenerationConfig(
            do_sample=True, temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        out = model.generate(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"],
                             generation_config=gen_cfg)
    model.train(was_training)
    P = enc["input_ids"].shape[1]
    resp = out[:, P:]
    if resp.shape[1] == 0:
        resp = torch.full((out.shape[0], 1), tokenizer.pad_token_id, dtype=out.dtype)
        out = torch.cat([out, resp], 1)
        scores = None
    is_eos = resp == tokenizer.eos_token_id
    # valid = positions up to and including the first EOS: a row without EOS ran every step (the
    # batch stops when all rows have ended), so only the pad after an EOS is padding; a pad token
    # the model drew mid-response is a token it attended to while sampling, and stays
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0
    resp_mask = (~after_eos).long()
    truncated = ~is_eos.any(-1)
    texts = [
        tokenizer.decode(r[m.bool()], skip_special_tokens=True) for r, m in zip(resp, resp_mask)
    ]
    attn = torch.cat([rows["attention_mask"], resp_mask], dim=1)
    scores = (None,) * 3 if scores is None else tuple(t * resp_mask for t in scores)
    return Rollout(out, attn, resp_mask, P, texts, truncated, *scores)


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


def concat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Stack rollouts with different prompt/response widths (re-padding both sides)."""
    P = max(p.prompt_len for p in parts)
    R = max(p.response_mask_BR.shape[1] for p in parts)
    seqs, attns, masks = [], [], []
    for p in parts:
        B, dp, dr = p.sequences_BL.shape[0], P - p.prompt_len, R - p.response_mask_BR.shape[1]
        left = torch.full((B, dp), pad_id, dtype=p.sequences_BL.dtype)
        right = torch.full((B, dr), pad_id, dtype=p.sequences_BL.dtype)
        seqs.append(torch.cat([left, p.sequences_BL, right], 1))
        z = lambda n: torch.zeros((B, n), dtype=p.attention_mask_BL.dtype)  # noqa: E731
        attns.append(torch.cat([z(dp), p.attention_mask_BL, z(dr)], 1))
        masks.append(torch.cat([p.response_mask_BR, z(dr)], 1))

    def scores(name):  # the sampler's per-token log-probs / entropy, right-padded with 0
        ts = [getattr(p, name) for p in parts]
        if any(t is None for t in ts):
            return None
        return torch.cat([F.pad(t, (0, R - t.shape[1])) for t in ts])

    return Rollout(
        torch.cat(seqs), torch.cat(attns), torch.cat(masks), P,
        [t for p in parts for t in p.responses], torch.cat([p.truncated_B for p in parts]),
        scores("logprobs_BR"), scores("entropy_BR"), scores("logmass_BR"),
    )
