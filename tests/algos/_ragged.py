"""A ragged batch of loss inputs for the competitor losses' tests (PAEC, RSI-S)."""

import torch


def ragged_batch(seed: int, B: int, T: int):
    """(generator, mask, log-probs, old log-probs, advantages, entropy): B rows of random
    lengths 1..T; the generator is returned so a test can draw more from the same stream."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    logp = -torch.rand(B, T, generator=g) * 3
    old = logp + 0.05 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).clone()
    ent = torch.rand(B, T, generator=g) * 2 + 0.05
    return g, mask, logp, old, adv, ent
