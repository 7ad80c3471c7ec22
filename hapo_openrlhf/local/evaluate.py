"""Held-out evaluation for the embedded trainer: Avg@k, Pass@k, mean response length."""

from __future__ import annotations

import torch

from ..data.templates import apply_template
from ..eval.metrics import summarize_samples
from ..rewards import MathVerifier
from ..generation.rollout import generate


def evaluate(model, tokenizer, problems, *, template: str, n: int, temperature: float, top_p: float,
             max_new_tokens: int, seed: int, batch_prompts: int = 64) -> dict[str, float]:
    """Sample ``n`` answers per problem under a private RNG (training randomness is
    untouched, and every evaluation of a run sees the same sampling noise)."""
    verifier = MathVerifier()
    scores, lengths = [], []
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for s in range(0, len(problems), batch_prompts):
            chunk = problems[s : s + batch_prompts]
            r = generate(model, tokenizer, [apply_template(template, p.problem) for p in chunk], n=n,
                         temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                         check_positions=True)
            lengths += r.response_mask_BR.sum(-1).tolist()
            for j, p in enumerate(chunk):
                scores.append([verifier.score(x, p.answer) for x in r.responses[j * n : (j + 1) * n]])
    verifier.close()
    out = summarize_samples(scores)
    out = {f"eval/{k}": v for k, v in out.items()}
    out["eval/accuracy"] = out[f"eval/avg@{n}"]
    out["eval/response_len"] = sum(lengths) / max(len(lengths), 1)
    return out
