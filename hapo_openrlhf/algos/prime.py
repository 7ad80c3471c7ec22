"""PRIME (Cui et al., arXiv 2502.01456): process rewards from an implicit PRM trained online.

Source of truth: the official recipe, verl ``recipe/prime/`` (verl commit 246cac4 is the last
with it in the tree; it now lives in ``verl-project/verl-recipe`` under ``prime/``). Each
function names the recipe function it restates; ``tests/algos/test_prime.py`` checks each
against a loop-for-loop restatement of the recipe. Shape legend: B responses, T response
tokens; ``mask`` [B, T] is the response mask (a leading run: a response's L = mask.sum() valid
tokens are its first L positions, as the recipe's ``attention_mask[:, prompt_len:]``).

The implicit PRM is a trainable model phi (started from the policy's initial weights) and a
frozen reference (by default the same weights). Per response token,

    q_t = log pi_phi(y_t | y_<t) - log pi_ref(y_t | y_<t),   0 from t = L on

(``prime_dp_rm.py``, ``DataParallelPRIMERewardModel._forward_micro_batch``). From q:

* token process rewards (``_forward_micro_batch``, the no-grad tail): r_t = beta q_t with
  lam = 0; with lam > 0 the reverse accumulation r_t = beta q_t + lam r_{t+1}. Granularity
  ``token`` keeps r on tokens 0..L-2 (the recipe writes ``[: L - 1]``: the last token's own
  process reward is dropped); ``whole`` puts sum_{t<L} r_t on token L-1.
* ``batch_norm`` (``DataParallelPRIMERewardModel.prime_norm``): the scores divided by the
  batch's largest |reverse cumulative sum| + 1e-6; ``none`` leaves them.
* the advantage (``prime_core_algos.py``, ``compute_rloo_advantage_return``): RLOO per reward
  source, then their weighted sum. Per source s with mask M_s, per response i of a group of n:
  m_i = the mean of its reward over M_s, b = sum_j m_j / (n - 1) (the sum includes i), and
  every reward on M_s becomes r n / (n - 1) - b (0 off M_s). The process source is the scores
  on the response mask, weight ``reward_dpo_coef``; the outcome source is the response's
  reward on its last token alone, weight ``reward_gt_coef``. Returns = the reverse cumulative
  sum of the total over the response (gamma 1); advantages = the returns whitened over every
  response token of the batch (verl's ``masked_whiten``: the Bessel-corrected variance,
  ``rsqrt(var + 1e-8)``), 0 off the response here (the recipe leaves padding to the loss mask).
* the PRM's loss (``compute_ce_dpo_loss_rm``): the binary cross-entropy of
  sigmoid(beta sum_t q_t) against the outcome (0 / 1), taken here from the logit (the
  recipe's ``binary_cross_entropy`` of the sigmoid clamps log at -100 and loses the gradient
  once the sigmoid rounds to 0 or 1; where it does not, the two agree).
* its accuracy (``compute_dpo_accuracy``): per group, over pairs i < j whose outcomes differ,
  the |outcome difference|-weighted share of pairs the summed q orders as the outcomes do (0.5
  for a group whose outcomes agree), averaged over groups.

Deviations (docs/method.md, "PRIME"): the groups are the batch's ``group_index`` (the recipe:
consecutive blocks of n); a response with no valid token contributes m_i = 0 (the recipe: a
NaN mean); a single response in a group is refused (the recipe divides by n - 1 = 0);
``whole`` with lam > 0 puts the sum of the accumulated r on the last token (the recipe's line
assigns a slice to one element); the outcome source is the run's reward (the verifier's
0 / 1 score unless the config adds a penalty), the PRM's label the verifier's outcome.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from .advantages import ESTIMATORS, AdvantageInputs, AdvantageOutput
from .groups import group_ids

GRANULARITIES = ("token", "whole")
NORMS = ("batch_norm", "none")


def _lengths(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool().sum(-1)


def implicit_q(prm_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, T] = log pi_phi - log pi_ref on the response, 0 beyond it (gradient through phi's)."""
    return (prm_logprobs - ref_logprobs.detach()) * mask.to(prm_logprobs.dtype)


def token_scores(q: torch.Tensor, mask: torch.Tensor, *, beta: float, lam: float = 0.0,
                 granularity: str = "token") -> torch.Tensor:
    """The token process rewards [B, T] from q (module docstring), no gradient."""
    q = q.detach().float() * mask.float()
    m, last = mask.bool(), last_token_mask(mask)
    r = beta * q
    if lam != 0.0:  # r_t = beta q_t + lam r_{t+1}, from the end of the row back
        acc = torch.zeros_like(r[:, 0])
        out = torch.zeros_like(r)
        for t in range(r.shape[-1] - 1, -1, -1):
            acc = r[:, t] + lam * acc
            out[:, t] = acc
        r = out
    if granularity == "token":  # the response's tokens but its last (the recipe's [: valid_length - 1])
        return torch.where(m & ~last, r, torch.zeros_like(r))
    whole = torch.where(m, r, torch.zeros_like(r)).sum(-1)
    return torch.where(last, whole.unsqueeze(-1), torch.zeros_like(r))


def batch_norm(scores: torch.Tensor) -> torch.Tensor:
    """``prime_norm: batch_norm``: divide by the batch's largest |reverse cumulative sum| + 1e-6."""
    rev = scores.flip(-1).cumsum(-1).flip(-1)
    return scores / (rev.abs().max() + 1e-6) if scores.numel() else scores


def rloo(reward: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """One source's leave-one-out rewards (``masked_rloo``): r n / (n - 1) - sum_j m_j / (n - 1) on
    ``mask``, 0 elsewhere; m_j the mean of response j's reward over its mask (0 with none)."""
    m = mask.bool()
    r = torch.where(m, reward.float(), torch.zeros_like(reward, dtype=torch.float32))
    cnt = m.sum(-1)
    mean_i = r.sum(-1) / cnt.clamp(min=1)
    gid, K = group_ids(group_index)
    n = torch.zeros(K, dtype=torch.float32, device=r.device).index_add_(0, gid, torch.ones_like(mean_i))
    if K and bool((n < 2).any()):
        raise ValueError("prime: every group needs at least 2 responses (its leave-one-out baseline divides by n - 1)")
    total = torch.zeros(K, dtype=torch.float32, device=r.device).index_add_(0, gid, mean_i)
    ng = n[gid].unsqueeze(-1)
    out = r * (ng / (ng - 1)) - (total[gid] / (n[gid] - 1)).unsqueeze(-1)
    return torch.where(m, out, torch.zeros_like(out))


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_whiten`` (shift_mean): (x - mean) rsqrt(var + 1e-8) over ``mask``, the
    variance Bessel-corrected (a single valid value: variance 0); 0 off the mask."""
    m = mask.float()
    n = m.sum()
    if float(n) == 0:
        return torch.zeros_like(values)
    mean = (values * m).sum() / n
    var = (((values - mean) ** 2) * m).sum() / n * (n / (n - 1).clamp(min=1))
    return (values - mean) * torch.rsqrt(var + 1e-8) * m


def last_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: each response's last valid token (none for an empty response), wherever the row's
    response starts: the recipe's rows start at position 0 (verl's response tensor, the embedded
    trainer's); OpenRLHF's action masks start after the row's padding."""
    m = mask.bool()
    return m & (m.long().cumsum(-1) == _lengths(m).unsqueeze(-1))


def prime_advantages(scores: torch.Tensor, outcome: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor, *,
                     reward_dpo_coef: float, reward_gt_coef: float):
    """(advantages, returns, process part, outcome part) [B, T] each (``compute_rloo_advantage_return``)."""
    m = mask.bool()
    process = rloo(scores, m, group_index) * reward_dpo_coef
    last = last_token_mask(m)
    gt = torch.where(last, outcome.float().unsqueeze(-1), torch.zeros_like(scores, dtype=torch.float32))
    outcome_part = rloo(gt, last, group_index) * reward_gt_coef
    total = (process + outcome_part) * m.float()
    returns = total.flip(-1).cumsum(-1).flip(-1) * m.float()
    return masked_whiten(returns, m), returns, process, outcome_part


def prm_loss(q: torch.Tensor, outcome: torch.Tensor, mask: torch.Tensor, *, beta: float) -> torch.Tensor:
    """The PRM's cross-entropy (``compute_ce_dpo_loss_rm``): BCE(sigmoid(beta sum_t q_t), outcome),
    the mean over responses, from the logit."""
    logit = (q * mask.to(q.dtype)).sum(-1) * beta
    return F.binary_cross_entropy_with_logits(logit, outcome.to(logit.dtype))


def pairwise_accuracy(q: torch.Tensor, outcome: torch.Tensor, mask: torch.Tensor, group_index: torch.Tensor) -> float:
    """``compute_dpo_accuracy``: the share of differing-outcome pairs in a group whose summed q
    orders them as the outcomes do, weighted by |outcome difference|; 0.5 for a group whose
    outcomes agree; the mean over groups."""
    s = (q.detach().float() * mask.float()).sum(-1)
    a = outcome.float()
    gid, K = group_ids(group_index)
    B = s.shape[0]
    upper = torch.triu(torch.ones(B, B, dtype=torch.bool, device=s.device), diagonal=1) & (gid[:, None] == gid[None, :])
    ad, sd = a[:, None] - a[None, :], s[:, None] - s[None, :]
    w = ad.abs() * upper
    hit = ((sd > 0) == (ad > 0)).float() * w
    pair_of = gid[:, None].expand(B, B)
    num = torch.zeros(K, device=s.device).index_add_(0, pair_of[upper], hit[upper])
    den = torch.zeros(K, device=s.device).index_add_(0, pair_of[upper], w[upper])
    acc = torch.where(den > 0, num / den.clamp(min=1e-30), torch.full_like(den, 0.5))
    return float(acc.mean()) if K else 0.5


def outcome_auc(q: torch.Tensor, outcome: torch.Tensor, mask: torch.Tensor) -> float:
    """The area under the ROC curve of sum_t q_t as a predictor of the outcome across the batch
    (ties count 1/2); NaN when the batch holds one outcome only."""
    s = (q.detach().double() * mask.double()).sum(-1)
    pos, neg = s[outcome.bool()], s[~outcome.bool()]
    if not pos.numel() or not neg.numel():
        return float("nan")
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())


def prm_beta(estimator: str, params: Mapping[str, Any]) -> float:
    """The PRM's beta (the recipe's ``beta_train``): the estimator's, its registered default where the
    config leaves it out -- the PRM's loss and the process rewards share it, on every back end."""
    return float({**ESTIMATORS.get(estimator).defaults, **params}["beta"])


def prm_metrics(seen: torch.Tensor, q: torch.Tensor, outcome: torch.Tensor, mask: torch.Tensor,
                group_index: torch.Tensor, *, beta: float) -> dict[str, float]:
    """The implicit PRM's metrics for one RL step: on ``seen`` -- the responses as the PRM scored them
    before training on them (held out) -- the pairwise accuracy, the AUC (left out when the batch holds
    one outcome) and the implicit outcome prediction sigmoid(beta sum q) > 1/2; on ``q`` (what the
    policy reads) the pairwise accuracy. Every back end logs these."""
    metrics = {"prm/acc_heldout": pairwise_accuracy(seen, outcome, mask, group_index)}
    auc = outcome_auc(seen, outcome, mask)
    if math.isfinite(auc):
        metrics["prm/auc_heldout"] = auc
    logit = beta * (seen * mask).sum(-1)
    metrics["prm/outcome_acc_heldout"] = float(((logit > 0) == outcome.bool()).float().mean())
    metrics["prm/acc"] = pairwise_accuracy(q, outcome, mask, group_index)
    return metrics


def _check(p: Mapping[str, Any]) -> None:
    if not p["beta"] > 0:
        raise ValueError(f"prime.beta must be > 0 (the implicit reward's scale; the recipe's beta_train 0.05), "
                         f"got {p['beta']}")
    if not 0 <= p["lam"] <= 1:
        raise ValueError(f"prime.lam must be in [0, 1] (the reverse accumulation's discount), got {p['lam']}")
    if p["granularity"] not in GRANULARITIES:
        raise ValueError(f"prime.granularity must be one of {GRANULARITIES} (the recipe's prime_granularity), "
                         f"got {p['granularity']!r}")
    if p["norm"] not in NORMS:
        raise ValueError(f"prime.norm must be one of {NORMS} (the recipe's prime_norm), got {p['norm']!r}")
    for key in ("reward_dpo_coef", "reward_gt_coef"):
        if not p[key] >= 0:
            raise ValueError(f"prime.{key} must be >= 0 (a source's weight), got {p[key]}")
    if p["reward_dpo_coef"] == 0 and p["reward_gt_coef"] == 0:
        raise ValueError("prime.reward_dpo_coef and prime.reward_gt_coef are both 0: no reward reaches the policy")


@ESTIMATORS.register("prime", validate=_check, trains_prm=True)
def prime(inputs: AdvantageInputs, *, beta: float = 0.05, lam: float = 0.0, granularity: str = "token",
          norm: str = "batch_norm", reward_dpo_coef: float = 5.0, reward_gt_coef: float = 5.0) -> AdvantageOutput:
    """PRIME's advantage from the implicit PRM's q (``inputs.process_q``) and the outcome reward."""
    if inputs.process_q is None:
        raise ValueError("prime needs the implicit PRM's q per response token (AdvantageInputs.process_q): the "
                         "trainer computes it with the PRM that its `prm` config section describes")
    mask = inputs.response_mask.bool()
    if not bool(torch.isfinite(inputs.process_q[mask]).all()):
        raise ValueError("prime: the implicit PRM's q holds NaN or inf on a response token")
    scores = token_scores(inputs.process_q, mask, beta=beta, lam=lam, granularity=granularity)
    if norm == "batch_norm":
        scores = batch_norm(scores)
    adv, returns, process, outcome = prime_advantages(scores, inputs.rewards, mask, inputs.group_index,
                                                      reward_dpo_coef=reward_dpo_coef, reward_gt_coef=reward_gt_coef)
    p_abs, o_abs = float(process[mask].abs().sum()), float(outcome[mask].abs().sum())
    metrics = {
        "prime/process_share": p_abs / (p_abs + o_abs) if p_abs + o_abs > 0 else math.nan,
        "prime/process_reward": float(scores.sum(-1).mean()),  # the recipe's reward_model/reward
        "prime/q_sum": float((inputs.process_q.detach().float() * mask).sum(-1).mean()),  # reward_model/raw_reward
        "prime/return_abs_mean": float(returns[mask].abs().mean()) if bool(mask.any()) else 0.0,
    }
    return AdvantageOutput(adv, metrics=metrics)
