"""Sampling ``n`` responses per prompt (``generate``) into a ``Rollout``: what the embedded
trainer trains on and what ``hapo eval --engine hf`` scores (``sampler.KVSampler``: Hugging Face
``generate``'s sampling rule, its log-probs and entropy recorded as it draws).

Shape legend: B sequences, P prompt tokens (left padded), R response tokens
(right padded), L = P + R.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    # the mask is a prefix (through the first EOS): each row's valid ids are its first n, decoded from lists
    texts = tokenizer.batch_decode([r[:n] for r, n in zip(resp.tolist(), resp_mask.sum(-1).tolist())],
                                   skip_special_tokens=True)
    attn = torch.cat([rows["attention_mask"], resp_mask], dim=1)
    scores = (None,) * 3 if scores is None else tuple(t * resp_mask for t in scores)
    return Rollout(out, attn, resp_mask, P, texts, truncated, *scores)


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
