"""Supervised warm-up on worked synthetic solutions (so RL starts from a model that
sometimes answers right: a random tiny model solves nothing and gets no signal)."""

from __future__ import annotations

import random

import torch

from ..data.templates import apply_template


def sft_batch(tokenizer, task, template: str, rng: random.Random, batch_size: int):
    """(input_ids, attention_mask, labels) with labels = -100 on prompt and padding."""
    ids, labels = [], []
    for _ in range(batch_size):
        text, _, _ = task.sample(rng)
        while task.is_heldout(text):
            text, _, _ = task.sample(rng)
        p = tokenizer(apply_template(template, text), add_special_tokens=False).input_ids
        r = tokenizer(task.solution(text, rng), add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        ids.append(p + r)
        labels.append([-100] * len(p) + r)
    L = max(map(len, ids))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (L - len(x)) + x for x in ids])
    attn = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in ids])
    lab = torch.tensor([[-100] * (L - len(x)) + x for x in labels])
    return input_ids, attn, lab


def warmup(model, tokenizer, task, template: str, *, steps: int, batch_size: int, lr: float, seed: int, on_step=None):
    """Train ``steps`` AdamW steps (cosine LR); returns the last loss."""
    if steps == 0:
        return float("nan")
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if steps >= 3:
        # 10% warm-up; at least two steps of it, so short warm-ups (smoke tests) have both phases
        pct = min(0.5, max(0.1, 2 / steps))
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=pct)
    else:  # OneCycleLR cannot split fewer than 3 steps into its two phases
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    model.train()
    loss_val = float("nan")
    for step in range(steps):
        input_ids, attn, labels = sft_batch(tokenizer, task, template, rng, batch_size)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=input_ids, attention_mask=attn, position_ids=pos, labels=labels, use_cache=False)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_val = float(out.loss.detach())
        if on_step is not None:
            on_step(step, loss_val)
    return loss_val
