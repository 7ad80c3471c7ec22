"""Pure-torch algorithm core: entropy, advantage estimators, policy losses,
quadrant diagnostics and DAPO pieces. Imports torch only."""

from .advantages import (
    ESTIMATORS,
    AdvantageInputs,
    AdvantageOutput,
    compute_advantages,
    list_estimators,
    outcome_polarity,
    run_estimator,
    split_quadrants,
)
from .hapo import hapo_credit, hapo_multiplier
from . import eapo, less, paec, pepo, prime, rsi, stare, unpublished  # noqa: F401 - register the competitors (one module a family)
from .groups import group_mean_std, group_token_entropy_stats
from .dapo import DynamicSamplingBuffer, informative_groups, overlong_penalty
from .entropy import check_finite, entropy_from_logits, logprobs_and_entropy, logprobs_from_logits
from .fused import fused_logprobs_entropy, fused_token_loss
from .vocab_parallel import vocab_parallel_logprobs_entropy
from .losses import AGGREGATIONS, LOSSES, aggregate, compute_policy_loss, default_normalizer, head_signals_top_p, k3_kl, list_losses, loss_observe, loss_resume, loss_step_state, CheckpointStateError, check_loss_state
from .quadrants import (
    QUADRANTS,
    SPLITS,
    check_split,
    entropy_cut,
    entropy_threshold,
    normalize_quadrants,
    quadrant_entropy_change,
    quadrant_masks,
    quadrant_metrics,
)

__all__ = [
    "vocab_parallel_logprobs_entropy",
    "AGGREGATIONS", "ESTIMATORS", "LOSSES", "QUADRANTS", "AdvantageInputs", "AdvantageOutput",
    "DynamicSamplingBuffer", "aggregate", "check_finite", "compute_advantages", "compute_policy_loss",
    "default_normalizer", "entropy_from_logits", "fused_logprobs_entropy", "fused_token_loss", "entropy_threshold", "group_mean_std", "hapo_multiplier",
    "SPLITS", "check_split", "entropy_cut", "group_token_entropy_stats", "hapo_credit", "outcome_polarity",
    "split_quadrants",
    "informative_groups", "k3_kl", "list_estimators", "list_losses", "logprobs_and_entropy",
    "logprobs_from_logits", "head_signals_top_p", "loss_observe", "loss_resume", "loss_step_state", "CheckpointStateError", "check_loss_state", "normalize_quadrants", "overlong_penalty", "quadrant_entropy_change",
    "quadrant_masks", "quadrant_metrics", "run_estimator",
]
