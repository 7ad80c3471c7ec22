"""TEST ORACLE: PRIME's computations restated loop for loop from the official recipe (verl
``recipe/prime/``, the last tree with it: verl 246cac4), on a padded batch whose groups are
consecutive blocks of ``n`` responses, as the recipe's are. Each function names the recipe
function it restates; nothing here is vectorised or shared with ``algos/prime.py``."""

import torch


def masked_mean(values, mask):
    """verl.utils.torch_functional.masked_mean (no axis) of that time."""
    return (values * mask).sum() / mask.sum()


def masked_whiten(values, mask):
    """verl.utils.torch_functional.masked_whiten (shift_mean=True) with masked_var(unbiased=True)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    var = var * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def forward_tail(q, max_positions, beta, lam, granularity):
    """prime_dp_rm.py, DataParallelPRIMERewardModel._forward_micro_batch, from ``q`` on: the
    q trimmed past each response, the token rewards r, the token-level score."""
    q = q.clone()
    num_actions = q.shape[1]
    for i in range(q.shape[0]):
        q[i, max_positions[i]:] = 0
    if lam == 0.0:
        r = q * beta
    else:
        q_ = q * beta
        r = torch.zeros_like(q)
        lastgaelam = 0
        for i in range(q.shape[0]):
            q_[i, max_positions[i]:] = 0
        for t in reversed(range(num_actions)):
            lastgaelam = q_[:, t] + lam * lastgaelam
            r[:, t] = lastgaelam
    score = torch.zeros_like(q)
    for i in range(q.shape[0]):
        if granularity == "token":
            score[i, :max_positions[i] - 1] = r[i, :max_positions[i] - 1]
        else:  # the recipe assigns r[i, :L] to one element; the sum is what the method means
            score[i, max_positions[i] - 1] = r[i, :max_positions[i]].sum()
    return score


def prime_norm(scores):
    """prime_dp_rm.py, DataParallelPRIMERewardModel.prime_norm (batch_norm)."""
    reverse_cumsum = torch.cumsum(scores.flip(dims=[1]), dim=-1).flip(dims=[1])
    return scores / (reverse_cumsum.abs().max() + 1e-6)


def masked_rloo(reward_original, mask, n):
    """prime_core_algos.py, compute_rloo_advantage_return's inner masked_rloo."""
    reward = reward_original.clone()
    reward[~mask] = 0
    for start in range(0, reward.shape[0], n):
        means = torch.cat([reward[pos:pos + 1][mask[pos:pos + 1]].mean(dim=0, keepdim=True)
                           for pos in range(start, start + n)], dim=0)
        baseline = means.sum() / (n - 1)
        block, block_mask = reward[start:start + n], mask[start:start + n]
        block[block_mask] = block[block_mask] * (n / (n - 1)) - baseline
    return reward


def rloo_advantage_return(rm_scores, acc, eos_mask, n, dpo_coef, gt_coef):
    """prime_core_algos.py, compute_rloo_advantage_return: (advantages, returns)."""
    parts = []
    if dpo_coef != 0.0:
        parts.append(masked_rloo(rm_scores, eos_mask.bool(), n) * dpo_coef)
    if gt_coef != 0.0:
        reward = torch.zeros_like(eos_mask, dtype=torch.float32)
        reward_mask = torch.zeros_like(eos_mask, dtype=torch.bool)
        L = eos_mask.sum(-1)
        reward_mask[torch.arange(L.shape[0]), L - 1] = True
        reward[torch.arange(L.shape[0]), L - 1] = acc
        parts.append(masked_rloo(reward, reward_mask, n) * gt_coef)
    final = sum(parts)
    returns = (final * eos_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return masked_whiten(returns.clone(), eos_mask), returns


def ce_dpo_loss(q, acc, eos_mask, beta):
    """prime_core_algos.py, compute_ce_dpo_loss_rm."""
    scores = ((q * eos_mask).sum(dim=1) * beta).sigmoid()
    return torch.nn.functional.binary_cross_entropy(scores, acc)


def dpo_accuracy(q, acc, eos_mask, n):
    """prime_core_algos.py, compute_dpo_accuracy."""
    out = []
    for start in range(0, q.shape[0], n):
        s = (q[start:start + n] * eos_mask[start:start + n]).sum(dim=1)

        def upper(x):
            d = x.unsqueeze(1) - x.unsqueeze(0)
            return d[torch.triu(torch.ones_like(d).bool(), diagonal=1)]

        acc_diff, score_diff = upper(acc[start:start + n]), upper(s)
        if acc_diff.abs().sum() == 0:
            cur = torch.zeros_like(score_diff[0]) + 0.5
        else:
            cur = (((score_diff > 0) == (acc_diff > 0)).float() * acc_diff.abs()).sum() / acc_diff.abs().sum()
        out.append(cur.unsqueeze(0))
    return torch.cat(out).mean()
