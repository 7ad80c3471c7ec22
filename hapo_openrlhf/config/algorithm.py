"""The algorithm: the estimator and the loss by registry name with their parameters (checked against
the registered functions), the aggregation, DAPO's pieces, the mismatch correction, the quadrants."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from ..algos import ESTIMATORS, LOSSES, check_split
from ..algos.losses import AGGREGATIONS
from .base import choices, freeze, require


@dataclass(frozen=True)
class OverlongConfig:
    enable: bool = False
    cache_len: int = 8


@dataclass(frozen=True)
class AccuracyFilterConfig:
    """PRIME's data filter (verl ``recipe/prime``, ``RayPRIMETrainer.filter_and_downsample``): sample
    ``oversample`` x the step's prompts, rank the groups whose accuracy lies in [lower, upper] (and, with
    ``drop_truncated``, none of whose responses reach max_new_tokens - 1 tokens) first, in sampled order,
    and train on the first ``rollout.prompts_per_step`` groups; failing groups fill in when too few pass."""

    enable: bool = False
    lower: float = 0.2
    upper: float = 0.8
    oversample: float = 4.0
    drop_truncated: bool = True

    def __post_init__(self):
        for key in ("lower", "upper"):
            v = getattr(self, key)
            require(math.isfinite(v) and 0 <= v <= 1,
                    f"algorithm.accuracy_filter.{key} must be a group accuracy in [0, 1], got {v}")
        require(self.lower <= self.upper, f"algorithm.accuracy_filter: lower ({self.lower}) is above upper "
                                          f"({self.upper}): no group could pass")
        require(math.isfinite(self.oversample) and self.oversample >= 1,
                f"algorithm.accuracy_filter.oversample must be a finite number >= 1 (prompts sampled per prompt "
                f"trained), got {self.oversample}")


@dataclass(frozen=True)
class ISCorrectionConfig:
    """Rollout/training mismatch correction (``algos.is_correction``; OpenRLHF 0.11.2's
    ``--algo.advantage.is_correction_*``): ``level`` off | token | seq, ``mode`` mask |
    clip, ``gating`` ratio | binary_kl | tv, ``threshold`` [low, high] or [high]."""

    level: str = "off"
    mode: str = "mask"
    gating: str = "ratio"
    threshold: tuple[float, ...] = (0.5, 5.0)
    # which engine log-probs stand for the behaviour policy (docs/method.md 6b): "raw", the
    # full-vocabulary log-prob at the rollout temperature (what the trainer's old log-prob is,
    # so an on-policy log-ratio is 0 up to numerics); "processed", the sampler's, renormalised
    # over the top-p nucleus (OpenRLHF 0.11.2's choice: biased by log P(nucleus) under top-p)
    behaviour: Literal["raw", "processed"] = "raw"

    def __post_init__(self):
        from ..algos.is_correction import ISCorrection

        try:
            spec = ISCorrection(self.level, self.mode, self.gating, tuple(self.threshold))
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None
        object.__setattr__(self, "threshold", spec.threshold)
        require(self.behaviour in choices(type(self), "behaviour"),
                 f"algorithm.is_correction.behaviour must be one of {BEHAVIOURS}, got {self.behaviour!r}")

    @property
    def enabled(self) -> bool:
        return self.level != "off"


BEHAVIOURS = choices(ISCorrectionConfig, "behaviour")


@dataclass(frozen=True)
class AlgorithmConfig:
    estimator: str = "hapo"
    estimator_params: Mapping[str, Any] = field(default_factory=dict)
    loss: str = "ppo"
    loss_params: Mapping[str, Any] = field(default_factory=dict)
    aggregation: str = "token-mean"
    kl_coef: float = 0.0
    dynamic_sampling: bool = False
    max_gen_rounds: int = 4
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    # PRIME's group-accuracy filter with oversampling (the embedded trainer)
    accuracy_filter: AccuracyFilterConfig = field(default_factory=AccuracyFilterConfig)
    # rollout/training mismatch correction (backend openrlhf / megatron: vLLM's log-probs)
    is_correction: ISCorrectionConfig = field(default_factory=ISCorrectionConfig)
    # the logged Four Quadrant metrics: high entropy = H >= the group's mean token entropy
    # (as published); or "quantile" (the batch's quadrant_quantile) or "value" (quadrant_threshold)
    quadrant_split: str = "group_mean"
    quadrant_quantile: float = 0.8
    quadrant_threshold: float | None = None
    entropy_chunk_size: int = 1024
    reward_wrong: float = 0.0
    reward_timeout_s: float = 5.0

    def __post_init__(self):
        # numbers as users write them (YAML 1.1 reads 1e-3 as a string; the typed keys accept it)
        object.__setattr__(self, "estimator_params",
                           freeze(ESTIMATORS.coerce_params(self.estimator, self.estimator_params)))
        object.__setattr__(self, "loss_params", freeze(LOSSES.coerce_params(self.loss, self.loss_params)))
        ESTIMATORS.check_params(self.estimator, self.estimator_params)
        LOSSES.check_params(self.loss, self.loss_params)
        require(self.aggregation in AGGREGATIONS, f"algorithm.aggregation must be one of {AGGREGATIONS}")
        require(self.kl_coef >= 0, "algorithm.kl_coef must be >= 0")
        require(0 < self.quadrant_quantile < 1, "algorithm.quadrant_quantile must be in (0, 1)")
        check_split(self.quadrant_split, self.quadrant_quantile, self.quadrant_threshold, "algorithm.quadrant_")
        require(self.entropy_chunk_size > 0, "algorithm.entropy_chunk_size must be > 0")
        require(self.max_gen_rounds >= 1, "algorithm.max_gen_rounds must be >= 1")
        require(not (self.dynamic_sampling and self.accuracy_filter.enable),
                "algorithm.dynamic_sampling and algorithm.accuracy_filter are two filters of the step's groups "
                "(DAPO's: accuracy strictly between 0 and 1, refilled; PRIME's: a band, oversampled once): enable one")
        require(self.reward_timeout_s > 0, "algorithm.reward_timeout_s must be > 0")
