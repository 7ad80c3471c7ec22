"""Per-group statistics (a group = the G responses to one prompt).

Shape legend: B sequences, T response tokens, K groups. Every tensor created
here lives on the inputs' device (a CUDA batch never meets a CPU buffer).
"""

from __future__ import annotations

import torch


def masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``m`` is set (0 when there are none)."""
    m = m.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def group_ids(group_index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense group ids 0..K-1 [B] (same value = same prompt, any order) and K."""
    _, inv = torch.unique(group_index, return_inverse=True)
    return inv, int(inv.max()) + 1 if inv.numel() else 0


def _zeros(K: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(K, dtype=torch.float64, device=like.device)


def group_mean_std(values_B: torch.Tensor, group_index: torch.Tensor, unbiased: bool = True):
    """Per-sequence mean and std of its group's values ([B] each). Singleton groups: std 0."""
    gid, K = group_ids(group_index)
    v = values_B.double()
    cnt = _zeros(K, v).index_add_(0, gid, torch.ones_like(v))
    mean = _zeros(K, v).index_add_(0, gid, v) / cnt
    sq = _zeros(K, v).index_add_(0, gid, (v - mean[gid]) ** 2)
    denom = (cnt - 1).clamp(min=1) if unbiased else cnt
    std = torch.where(cnt > 1, (sq / denom).sqrt(), torch.zeros_like(sq))
    return mean[gid].to(values_B.dtype), std[gid].to(values_B.dtype)


def group_token_entropy_stats(
    entropy_BT: torch.Tensor, mask_BT: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """mu_H, sigma_H of the (detached) entropy over all valid tokens of each sequence's
    group, as [B,1] fp32. sigma is the population std (divide by the token count);
    a group without valid tokens gets mu = sigma = 0."""
    gid, K = group_ids(group_index)
    valid = mask_BT.bool()
    # padding may hold anything (even NaN): it never enters the sums
    H = torch.where(valid, entropy_BT.detach().double(), torch.zeros((), dtype=torch.float64, device=valid.device))
    cnt = _zeros(K, H).index_add_(0, gid, valid.double().sum(-1))
    s1 = _zeros(K, H).index_add_(0, gid, H.sum(-1))
    mu = s1 / cnt.clamp(min=1)
    dev = torch.where(valid, (H - mu[gid].unsqueeze(-1)) ** 2, torch.zeros_like(H))
    s2 = _zeros(K, H).index_add_(0, gid, dev.sum(-1))
    sigma = (s2 / cnt.clamp(min=1)).sqrt()
    return mu[gid].unsqueeze(-1).float(), sigma[gid].unsqueeze(-1).float()
