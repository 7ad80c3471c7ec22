"""Run configuration: one YAML file per run, loaded into frozen dataclasses.

Unknown keys are errors naming the dotted key (with a close match when there is
one); ranges are checked in ``__post_init__``. A config is never edited after
validation: overrides (``--set a.b=1``) are applied to the raw dict first.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from .algos import ESTIMATORS, LOSSES, check_split
from .algos.losses import AGGREGATIONS


class FrozenDict(dict):
    """A read-only, picklable dict for free-form parameter maps."""

    def _ro(self, *a, **k):
        raise TypeError("config parameters are read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _ro  # type: ignore

    def __reduce__(self):
        return (FrozenDict, (dict(self),))


def _freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return FrozenDict({k: _freeze(x) for k, x in v.items()})
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# The tiny model's architecture when model.path is unset. With model.path these keys
# default to none: the loaded model's own config.json decides, and a key that is given is
# checked against it (local/model.py: check_architecture), never silently ignored.
TINY_ARCHITECTURE = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                     "intermediate_size": 384, "max_position_embeddings": 256, "tie_word_embeddings": True,
                     "family": "qwen2"}


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # a Hugging Face model dir; None builds the tiny model below
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool | None = None
    # the tiny model's architecture when path is unset: qwen2 (the paper's), qwen3, llama
    family: str | None = None
    # LM head + log-prob + entropy fused and chunked over tokens (no [B, T, V] logits)
    fused_head: bool = True
    # with fused_head and a row-local loss (ppo, entro_reg) the embedded trainer computes
    # each chunk's gradient inside the head's forward (no logits recomputation)
    fused_loss_in_forward: bool = True
    # training forwards drop padding and run the rows as one packed sequence
    # (flash-attn varlen on GPU, a block-diagonal SDPA mask on CPU)
    packing: bool = False

    def __post_init__(self):
        if not self.path:  # the tiny model: its defaults fill what is not given
            for k, v in TINY_ARCHITECTURE.items():
                if getattr(self, k) is None:
                    object.__setattr__(self, k, v)
        for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_position_embeddings"):
            v = getattr(self, k)
            _require(v is None or v > 0, f"model.{k} must be > 0, got {v}")
        if self.hidden_size is not None and self.num_heads is not None:
            _require(self.hidden_size % self.num_heads == 0, "model.hidden_size must be divisible by model.num_heads")
        if self.num_heads is not None and self.num_kv_heads is not None:
            _require(self.num_heads % self.num_kv_heads == 0, "model.num_heads must be divisible by model.num_kv_heads")
        _require(self.family in (None, "qwen2", "qwen3", "llama"),
                 f"model.family must be one of qwen2, qwen3, llama, got {self.family!r}")

    def architecture_given(self) -> dict[str, Any]:
        """With ``path`` set: the architecture keys the config states (each must match the
        loaded model); without: every key (the tiny model is built from them)."""
        return {k: getattr(self, k) for k in TINY_ARCHITECTURE if getattr(self, k) is not None}


def _optional_seed(x) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**62)


# the largest synthetic train or held-out set (the draw keeps every problem in memory)
MAX_SYNTHETIC_PROBLEMS = 1_000_000


@dataclass(frozen=True)
class SyntheticConfig:
    n_terms: int = 3
    digits: int = 2
    ops: str = "+-"
    slip_prob: float = 0.0  # warm-up teacher's per-step error rate (see data/synthetic.py)
    shortcut_prob: float = 0.0  # share of warm-up answers given without the worked chain
    shortcut_error: float = 0.0  # how often such a direct warm-up answer is a near-miss guess
    # the chain variant (data/synthetic.py): min_terms .. n_terms terms; the teacher skips an
    # intermediate result with skip_prob per step, and such a merged step is a near miss with skip_error
    min_terms: int | None = None
    skip_prob: float = 0.0
    skip_error: float = 0.0
    train_size: int = 4000
    eval_size: int = 128
    # the held-out problems' draw; none: the run's seed + 1. A fixed value gives every run of an
    # experiment one held-out set (train problems still follow the run's seed)
    eval_seed: int | None = None

    def __post_init__(self):
        _require(_optional_seed(self.eval_seed),
                 f"data.synthetic.eval_seed must be none or an integer >= 0, got {self.eval_seed!r}")
        # named here, at load, rather than when the task is first built (data/synthetic.py checks again)
        _require(self.min_terms is None or 2 <= self.min_terms <= self.n_terms,
                 f"data.synthetic.min_terms must be in [2, n_terms={self.n_terms}], got {self.min_terms}")
        for k in ("slip_prob", "shortcut_prob", "skip_prob"):
            _require(0 <= getattr(self, k) < 1, f"data.synthetic.{k} must be in [0, 1), got {getattr(self, k)}")
        for k in ("shortcut_error", "skip_error"):
            _require(0 <= getattr(self, k) <= 1, f"data.synthetic.{k} must be in [0, 1], got {getattr(self, k)}")
        _require(2 <= self.n_terms <= 64, f"data.synthetic.n_terms must be in [2, 64], got {self.n_terms}")
        _require(1 <= self.digits <= 18, f"data.synthetic.digits must be in [1, 18], got {self.digits}")
        _require(bool(self.ops) and not set(self.ops) - set("+-*"),
                 f"data.synthetic.ops must be a non-empty string of '+', '-', '*', got {self.ops!r}")
        # sizes are checked before the draw: it makes up to 50 x n attempts, so a size near or over
        # what the task can produce would run for minutes before failing
        from .data.synthetic import ArithmeticTask

        task = ArithmeticTask(self.n_terms, self.digits, self.ops, min_terms=self.min_terms)
        for k, heldout in (("train_size", False), ("eval_size", True)):
            n = getattr(self, k)
            _require(1 <= n <= MAX_SYNTHETIC_PROBLEMS,
                     f"data.synthetic.{k} must be in [1, {MAX_SYNTHETIC_PROBLEMS}], got {n}")
            cap = task.side_capacity(heldout)
            _require(n <= cap * 0.95, f"data.synthetic.{k} ({n}) is more than 95% of the ~{cap} distinct "
                                    f"{'held-out' if heldout else 'training'} problems this task has "
                                    f"(n_terms {self.n_terms}, digits {self.digits}, ops {self.ops!r}); "
                                    f"lower it or make the task larger")


@dataclass(frozen=True)
class DataConfig:
    train: str = "synthetic"  # "synthetic", a bundled name, a file, or hf:<id>
    eval: str = "synthetic"
    template: str = "tiny"
    problem_field: str | None = None
    answer_field: str | None = None
    on_bad_row: str = "error"
    eval_limit: int | None = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)

    def __post_init__(self):
        from .data.templates import TEMPLATES

        _require(self.template in TEMPLATES, f"data.template must be one of {sorted(TEMPLATES)}, got {self.template!r}")
        _require(self.on_bad_row in ("error", "skip"), f"data.on_bad_row must be 'error' or 'skip', got {self.on_bad_row!r}")
        _require(self.eval_limit is None or self.eval_limit >= 1,
                 f"data.eval_limit must be >= 1 (or null: every problem), got {self.eval_limit}")
        for k in ("train", "eval"):
            _require(bool(str(getattr(self, k)).strip()), f"data.{k} must not be empty")


@dataclass(frozen=True)
class WarmupConfig:
    """Supervised warm-up on worked synthetic solutions before RL (embedded run)."""

    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3

    def __post_init__(self):
        _require(self.steps >= 0 and self.batch_size > 0 and self.lr > 0, "warmup: steps >= 0, batch_size > 0, lr > 0")


@dataclass(frozen=True)
class RolloutConfig:
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 40
    # under top-p < 1, log rollout/nucleus_logmass on RL steps 1, 1 + N, 1 + 2N, ... (0: never);
    # it costs a sort of every [chunk, V/TP] block of the old-log-prob pass (docs/performance.md)
    nucleus_metric_every: int = 1
    # the embedded trainer's old log-probs, behaviour entropy and nucleus mass: "sampler" (what
    # the sampler computed as it drew, from the same logits; no scoring forward) or "forward"
    # (a separate no-grad forward over the batch, as OpenRLHF recomputes them); they agree to
    # float tolerance (tests/local/test_sampler.py). Models the sampler does not serve use a forward.
    old_logprobs: str = "auto"  # auto: sampler on backend local, forward on the others

    def __post_init__(self):
        _require(self.prompts_per_step > 0, "rollout.prompts_per_step must be > 0")
        _require(self.old_logprobs in ("auto", "sampler", "forward"),
                 f"rollout.old_logprobs must be auto, sampler or forward, got {self.old_logprobs!r}")
        _require(self.samples_per_prompt >= 2, "rollout.samples_per_prompt must be >= 2 (group baselines)")
        _require(self.temperature > 0, "rollout.temperature must be > 0")
        _require(0 < self.top_p <= 1, "rollout.top_p must be in (0, 1]")
        _require(self.max_new_tokens > 0, "rollout.max_new_tokens must be > 0")
        _require(self.nucleus_metric_every >= 0,
                 f"rollout.nucleus_metric_every must be >= 0 (0: never), got {self.nucleus_metric_every}")


@dataclass(frozen=True)
class OverlongConfig:
    enable: bool = False
    cache_len: int = 8


BEHAVIOURS = ("raw", "processed")


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
    behaviour: str = "raw"

    def __post_init__(self):
        from .algos.is_correction import ISCorrection

        try:
            spec = ISCorrection(self.level, self.mode, self.gating, tuple(self.threshold))
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None
        object.__setattr__(self, "threshold", spec.threshold)
        _require(self.behaviour in BEHAVIOURS,
                 f"algorithm.is_correction.behaviour must be one of {BEHAVIOURS}, got {self.behaviour!r}")

    @property
    def enabled(self) -> bool:
        return self.level != "off"


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
                           _freeze(ESTIMATORS.coerce_params(self.estimator, self.estimator_params)))
        object.__setattr__(self, "loss_params", _freeze(LOSSES.coerce_params(self.loss, self.loss_params)))
        ESTIMATORS.check_params(self.estimator, self.estimator_params)
        LOSSES.check_params(self.loss, self.loss_params)
        _require(self.aggregation in AGGREGATIONS, f"algorithm.aggregation must be one of {AGGREGATIONS}")
        _require(self.kl_coef >= 0, "algorithm.kl_coef must be >= 0")
        _require(0 < self.quadrant_quantile < 1, "algorithm.quadrant_quantile must be in (0, 1)")
        check_split(self.quadrant_split, self.quadrant_quantile, self.quadrant_threshold, "algorithm.quadrant_")
        _require(self.entropy_chunk_size > 0, "algorithm.entropy_chunk_size must be > 0")
        _require(self.max_gen_rounds >= 1, "algorithm.max_gen_rounds must be >= 1")
        _require(self.reward_timeout_s > 0, "algorithm.reward_timeout_s must be > 0")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    lr_warmup_steps: int = 0
    grad_clip: float = 1.0
    ppo_epochs: int = 1
    micro_batch_size: int = 32
    # optimizer steps in a row with a non-finite gradient (each skipped) before the run stops
    # (every back end; hapo_openrlhf/grad_guard.py)
    max_consecutive_skips: int = 3

    def __post_init__(self):
        _require(math.isfinite(self.lr) and self.lr > 0, f"optim.lr must be a finite number > 0, got {self.lr}")
        _require(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "optim.weight_decay must be >= 0")
        _require(self.lr_warmup_steps >= 0, f"optim.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas must be two values in [0, 1)")
        _require(self.ppo_epochs >= 1 and self.micro_batch_size >= 1, "optim.ppo_epochs and optim.micro_batch_size must be >= 1")
        _require(math.isfinite(self.grad_clip) and self.grad_clip > 0, "optim.grad_clip must be a finite number > 0")
        _require(self.max_consecutive_skips >= 1,
                 f"optim.max_consecutive_skips must be >= 1, got {self.max_consecutive_skips}")


@dataclass(frozen=True)
class TrainerConfig:
    steps: int = 60
    eval_every: int = 0  # 0: only before and after RL
    save_every: int = 10
    keep_last: int = 2
    threads: int = 0  # torch intra-op threads; 0 leaves torch's default
    sample_every: int = 10  # dump token-level samples (token-credit view) every N steps; 0: never
    sample_count: int = 16

    def __post_init__(self):
        _require(self.steps >= 0, "trainer.steps must be >= 0")
        _require(self.save_every >= 0 and self.eval_every >= 0, "trainer.save_every/eval_every must be >= 0")
        _require(self.keep_last >= 1, "trainer.keep_last must be >= 1")
        _require(self.threads >= 0, f"trainer.threads must be >= 0 (0: torch's default), got {self.threads}")
        _require(self.sample_every >= 0, f"trainer.sample_every must be >= 0 (0: never), got {self.sample_every}")
        _require(self.sample_count >= 0, f"trainer.sample_count must be >= 0, got {self.sample_count}")


# samples per problem (Avg@k / Pass@k): the papers use k <= 64; more is a typo that would
# allocate k x problems x tokens before the first evaluation
MAX_SAMPLES = 4096
# a response budget: beyond any model this project trains (DeepScaleR's contexts are 24k)
MAX_NEW_TOKENS = 1 << 20


@dataclass(frozen=True)
class EvalConfig:
    temperature: float = 0.6
    top_p: float = 0.95
    n_samples: int = 4
    max_new_tokens: int = 40
    # the sampling seed of held-out evaluations; none: the run's seed + 99. A fixed seed gives
    # every run of an experiment the same sampling stream (common random numbers), so runs
    # from one warm start share its evaluation and paired differences lose that noise
    seed: int | None = None

    def __post_init__(self):
        _require(1 <= self.n_samples <= MAX_SAMPLES, f"eval.n_samples must be in [1, {MAX_SAMPLES}], got {self.n_samples}")
        _require(self.temperature > 0 and 0 < self.top_p <= 1, "eval: temperature > 0, top_p in (0, 1]")
        _require(1 <= self.max_new_tokens <= MAX_NEW_TOKENS,
                 f"eval.max_new_tokens must be in [1, {MAX_NEW_TOKENS}], got {self.max_new_tokens}")
        _require(_optional_seed(self.seed), f"eval.seed must be none or an integer >= 0, got {self.seed!r}")


@dataclass(frozen=True)
class OpenRLHFConfig:
    """Cluster layout and engine settings for ``backend: openrlhf`` (OpenRLHF 0.11.2).

    Everything algorithmic comes from the sections above; this section only says
    where and how OpenRLHF runs it. ``extra_args`` is an escape hatch appended to
    the generated flags (still checked by OpenRLHF's own parser)."""

    actor_num_nodes: int = 1
    actor_gpus_per_node: int = 8
    vllm_num_engines: int = 8
    vllm_tensor_parallel_size: int = 1
    # share of each engine GPU vLLM may take; none: 0.6 when colocated with the actors
    # (they need the rest), 0.9 when the engines have their own GPUs
    vllm_gpu_memory_utilization: float | None = None
    vllm_enforce_eager: bool = False
    vllm_enable_sleep: bool = True
    vllm_sync_backend: str = "nccl"
    colocate_all: bool = True
    zero_stage: int = 2
    param_dtype: str = "bf16"
    attn_implementation: str = "flash_attention_2"
    packing_samples: bool = True
    ring_attn_size: int = 1
    ring_attn_head_stride: int = 1
    gradient_checkpointing: bool = True
    adam_offload: bool = False
    ref_offload: bool = False
    max_len: int = 4096  # prompt + response tokens
    train_batch_size: int = 512  # samples per optimizer step (global)
    micro_train_batch_size: int = 4
    micro_rollout_batch_size: int = 8
    dynamic_batch: bool = False
    max_tokens_per_gpu: int = 16384
    num_episodes: int = 1
    max_samples: int = 100_000_000
    lr_scheduler: str = "constant_with_warmup"
    lr_warmup_ratio: float = 0.0
    eval_dataset: str | None = None  # a data spec (as data.eval); None: no in-training evaluation
    save_hf: bool = False
    # OpenRLHF's asynchronous trainer: generation (its own actor) runs up to async_queue_size rollout
    # batches ahead of training; partial_rollout: vLLM pauses for the weight sync instead of waiting
    # for the batch in flight to finish (docs/openrlhf.md, "Asynchronous training")
    async_: bool = field(default=False, metadata={"key": "async"})
    async_queue_size: int = 1
    partial_rollout: bool = False
    extra_args: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))
        if self.vllm_gpu_memory_utilization is None:
            object.__setattr__(self, "vllm_gpu_memory_utilization", 0.6 if self.colocate_all else 0.9)
        _require(0 < self.vllm_gpu_memory_utilization <= 1,
                 f"openrlhf.vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}")
        _require(self.actor_num_nodes >= 1 and self.actor_gpus_per_node >= 1, "openrlhf: actor nodes and GPUs must be >= 1")
        _require(self.vllm_num_engines >= 1 and self.vllm_tensor_parallel_size >= 1,
                 "openrlhf.vllm_num_engines and vllm_tensor_parallel_size must be >= 1 (HAPO rollouts need an engine)")
        _require(self.zero_stage in (0, 1, 2, 3), f"openrlhf.zero_stage must be 0-3, got {self.zero_stage}")
        _require(self.param_dtype in ("bf16", "fp16"), f"openrlhf.param_dtype must be bf16 or fp16, got {self.param_dtype!r}")
        # refused, not cast: the DeepSpeed actor's weight sync is OpenRLHF's own broadcast
        _require(self.param_dtype != "fp16",
                 "openrlhf.param_dtype: fp16 cannot run: OpenRLHF 0.11.2 creates every vLLM engine with dtype "
                 "bfloat16 (trainer/ray/vllm_engine.py, create_vllm_engines) and its worker asserts that each synced "
                 "weight has the engine's dtype (trainer/ray/vllm_worker_wrap.py, update_weight), so an fp16 actor "
                 "fails at the first weight sync; use bf16")
        _require(self.vllm_sync_backend in ("nccl", "gloo"), "openrlhf.vllm_sync_backend must be nccl or gloo")
        _require(self.ring_attn_size >= 1, "openrlhf.ring_attn_size must be >= 1")
        _require(self.ring_attn_size == 1 or self.packing_samples, "openrlhf.ring_attn_size > 1 needs packing_samples: true")
        world = self.actor_num_nodes * self.actor_gpus_per_node
        _require(world % self.ring_attn_size == 0,
                 f"openrlhf.ring_attn_size {self.ring_attn_size} must divide the actor world size {world}")
        _require(self.max_len > 0 and self.train_batch_size > 0 and self.micro_train_batch_size > 0
                 and self.micro_rollout_batch_size > 0, "openrlhf: max_len and batch sizes must be > 0")
        _require(self.max_tokens_per_gpu > 0, "openrlhf.max_tokens_per_gpu must be > 0")
        _require(self.async_queue_size >= 1, "openrlhf.async_queue_size must be >= 1")
        _require(not self.partial_rollout or self.async_, "openrlhf.partial_rollout needs openrlhf.async: true")
        _require(not (self.async_ and self.colocate_all and self.vllm_enable_sleep),
                 "openrlhf.async: true cannot use vLLM's sleep mode (generation runs while the actor trains); set "
                 "openrlhf.vllm_enable_sleep: false and give the engines their own GPUs (colocate_all: false)")
        _require(self.num_episodes >= 1, "openrlhf.num_episodes must be >= 1")
        _require(0 <= self.lr_warmup_ratio < 1, "openrlhf.lr_warmup_ratio must be in [0, 1)")


@dataclass(frozen=True)
class MegatronMoEConfig:
    """Mixture-of-experts settings of the Megatron actor (a Qwen3-MoE model; docs/megatron.md,
    "Mixture of experts": where each default comes from). Ignored for a dense model, but
    ``routing_replay: r3`` on one is refused (``families.check_actor_family``)."""

    dispatcher: str = "alltoall"  # megatron-core's token dispatcher (allgather needs equal token counts per EP rank)
    aux_loss_coeff: float = 0.0  # the load-balancing loss (0: none, slime's RL default; moe.scaled_aux_loss)
    freeze_router: bool = False  # keep every router's weight at its checkpoint value
    # off | r3: replay the rollout's routed experts in the old-log-prob and training forwards (the engines
    # return them: vLLM with enable_return_routed_experts on GPUs; integrations/openrlhf/routes.py)
    routing_replay: str = "off"

    def __post_init__(self):
        _require(self.dispatcher in ("alltoall", "allgather"),
                 f"megatron.moe.dispatcher must be alltoall or allgather, got {self.dispatcher!r}")
        _require(self.aux_loss_coeff >= 0, f"megatron.moe.aux_loss_coeff must be >= 0, got {self.aux_loss_coeff}")
        _require(self.routing_replay in ("off", "r3"),
                 f"megatron.moe.routing_replay must be off or r3, got {self.routing_replay!r}")


@dataclass(frozen=True)
class MegatronConfig:
    """The Megatron-core policy actor (``backend: megatron``; docs/megatron.md).

    OpenRLHF's controller, vLLM engines, reward and hapo's experience maker are the
    same as ``backend: openrlhf`` (the ``openrlhf`` section still places them and sets
    the batch sizes); only the policy actor is Megatron's GPTModel, split
    ``tensor_parallel`` x ``pipeline_parallel`` ways per data-parallel replica."""

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1  # must be 1: the schedule does not split sequences across CP ranks
    sequence_parallel: bool = False  # needs layer_spec: te (megatron-core's torch norms refuse it)
    params_dtype: str = "bf16"  # bf16 | fp32 (weights, activations and the AdamW moments' params)
    vocab_multiple: int = 128  # the vocabulary is padded to a multiple of this x tensor_parallel
    recompute: bool = False  # full activation recomputation, every layer (the 24k memory lever)
    timeout_minutes: int = 60  # torch.distributed collectives
    # flash: hapo's FlashCoreAttention (flash-attn varlen / causal SDPA, packed or right-padded rows);
    # local: megatron-core's DotProductAttention ([S, S] scores and an explicit mask; for comparison)
    attention: str = "flash"
    # local: megatron-core's local spec (torch norms and linears; ``attention`` picks its core attention);
    # te: Transformer Engine's spec (fused norm + linear, TE's attention; needs transformer-engine on CUDA)
    layer_spec: str = "local"
    # fused: log-probs and entropy from the hidden states and the head shard, chunk by chunk (no
    # [T, V/TP] logits; megatron/head.py); logits: Megatron's output layer, then the vocabulary-
    # parallel reductions (for comparison); auto: fused with attention: flash, logits with local
    head: str = "auto"
    # Megatron's DistributedOptimizer (fp32 masters and Adam moments sharded over data parallelism,
    # megatron/ddp.py): null (default) = on when DP > 1; false = every rank holds the whole state
    distributed_optimizer: bool | None = None
    # how the distributed optimizer's state is checkpointed, and so which layout a resume may change:
    # dp_reshardable (each rank writes its shards in parallel; resume at another DP size only) or
    # fully_reshardable (gathered per parameter on save; resume under any TP x PP x DP)
    optimizer_sharding: str = "dp_reshardable"
    # mixture of experts: expert-parallel ranks, carved out of data parallelism (each expert lives on
    # DP / expert_parallel replicas; expert tensor parallelism is TP), and the router settings
    expert_parallel: int = 1
    moe: MegatronMoEConfig = field(default_factory=MegatronMoEConfig)

    def __post_init__(self):
        _require(self.tensor_parallel >= 1 and self.pipeline_parallel >= 1 and self.expert_parallel >= 1,
                 "megatron.tensor_parallel, pipeline_parallel and expert_parallel must be >= 1")
        _require(self.attention in ("flash", "local"), f"megatron.attention must be flash or local, got {self.attention!r}")
        _require(self.layer_spec in ("local", "te"), f"megatron.layer_spec must be local or te, got {self.layer_spec!r}")
        _require(self.layer_spec != "te" or self.attention == "flash",
                 "megatron.attention: local is the local spec's DotProductAttention; with megatron.layer_spec: te "
                 "the core attention is Transformer Engine's (leave attention: flash, the default)")
        _require(self.head in ("auto", "fused", "logits"), f"megatron.head must be auto, fused or logits, got {self.head!r}")
        _require(self.distributed_optimizer in (None, True, False),
                 f"megatron.distributed_optimizer must be true, false or null (on when DP > 1), "
                 f"got {self.distributed_optimizer!r}")
        _require(self.optimizer_sharding in ("dp_reshardable", "fully_reshardable"),
                 f"megatron.optimizer_sharding must be dp_reshardable or fully_reshardable, "
                 f"got {self.optimizer_sharding!r}")
        _require(self.context_parallel == 1,
                 "megatron.context_parallel > 1 is not supported: hapo's Megatron schedule does not split sequences "
                 "across context-parallel ranks (docs/megatron.md); use tensor/pipeline parallelism, packing and "
                 "recompute for long contexts")
        _require(not self.sequence_parallel or self.layer_spec == "te",
                 "megatron.sequence_parallel needs megatron.layer_spec: te (Transformer Engine's norms); "
                 "megatron-core's local spec builds torch norms, which refuse it (docs/megatron.md)")
        _require(not self.sequence_parallel or self.tensor_parallel > 1,
                 "megatron.sequence_parallel splits tokens over tensor-parallel ranks: it needs tensor_parallel > 1")
        _require(self.params_dtype in ("bf16", "fp32"), f"megatron.params_dtype must be bf16 or fp32, got {self.params_dtype!r}")
        _require(self.vocab_multiple >= 1 and self.timeout_minutes >= 1, "megatron.vocab_multiple and timeout_minutes must be >= 1")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel


@dataclass(frozen=True)
class SlurmConfig:
    """How ``hapo submit`` asks Slurm to warn the job before its time limit (docs/cluster.md).

    The warning (``--signal=B:USR1@<lead>``) must come early enough for the step in flight
    to finish and checkpoint: a 24k-token step takes tens of minutes. ``signal_lead_s``
    sets it; otherwise it is 1.5 x ``expected_step_s`` + 300 s when that is given, else a
    heuristic from the response length and model size (``cluster.sbatch.signal_lead_seconds``)."""

    signal_lead_s: int | None = None
    expected_step_s: float | None = None

    def __post_init__(self):
        _require(self.signal_lead_s is None or 30 <= self.signal_lead_s <= 65535,
                 f"slurm.signal_lead_s must be in 30..65535 seconds (Slurm's --signal limit), got {self.signal_lead_s}")
        _require(self.expected_step_s is None or 0 < self.expected_step_s <= 43000,
                 f"slurm.expected_step_s must be in (0, 43000] seconds (1.5 x it + 300 s is the signal lead, at most "
                 f"65535 s), got {self.expected_step_s}")


@dataclass(frozen=True)
class RunConfig:
    run_name: str = "run"
    seed: int = 1234
    output_dir: str = "runs/run"
    backend: str = "local"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    openrlhf: OpenRLHFConfig = field(default_factory=OpenRLHFConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self):
        _require(0 <= self.seed < 2**32 - 100, f"seed must be an integer in [0, 2^32 - 100) (numpy's seed range, less "
                                               f"the offsets the trainer adds), got {self.seed}")
        _require(self.backend in ("local", "openrlhf", "megatron"), f"backend must be local, openrlhf or megatron, got {self.backend!r}")
        _require(bool(str(self.output_dir).strip()), "output_dir must not be empty (it would write into the current "
                                                      "directory); name a run directory")
        _require(bool(str(self.run_name).strip()) and "\n" not in str(self.run_name), "run_name must be one non-empty line")
        if self.backend == "local" and not self.model.path:
            from .data.templates import TEMPLATES

            # the tiny model's byte positions must hold a templated prompt + the response (a lower bound
            # for synthetic prompts; real prompts are checked as they are tokenized)
            syn = self.data.synthetic
            prompt = len(TEMPLATES[self.data.template].format(problem="")) + syn.n_terms * (syn.digits + 3)
            need = max(self.rollout.max_new_tokens, self.eval.max_new_tokens) + prompt
            _require(self.model.max_position_embeddings >= need,
                     f"model.max_position_embeddings ({self.model.max_position_embeddings}) is smaller than prompt + "
                     f"response (>= {need} tokens: max_new_tokens {need - prompt} + a ~{prompt}-token prompt)")
        if self.backend == "megatron":
            self._check_megatron()
        _require(self.backend == "local" or self.rollout.old_logprobs != "sampler",
                 f"rollout.old_logprobs: sampler is the embedded trainer's (backend local); backend {self.backend} "
                 "recomputes old log-probs with the actor, as OpenRLHF does: set rollout.old_logprobs: auto or forward "
                 "(vLLM's own log-probs enter through algorithm.is_correction)")

    @property
    def routing_replay(self) -> bool:
        """Rollout routing replay is on: the Megatron actor replays the rollout's routed experts."""
        return self.backend == "megatron" and self.megatron.moe.routing_replay == "r3"

    def _check_megatron(self) -> None:
        o, m = self.openrlhf, self.megatron
        world = o.actor_num_nodes * o.actor_gpus_per_node
        _require(world % m.model_parallel_size == 0,
                 f"backend megatron: tensor_parallel x pipeline_parallel ({m.model_parallel_size}) must divide the "
                 f"actor world size (openrlhf.actor_num_nodes x actor_gpus_per_node = {world})")
        dp = world // m.model_parallel_size
        _require(dp % m.expert_parallel == 0,
                 f"backend megatron: expert_parallel {m.expert_parallel} must divide the data-parallel size {dp} "
                 f"(world {world} / tensor_parallel {m.tensor_parallel} / pipeline_parallel {m.pipeline_parallel}): "
                 f"expert parallelism is carved out of data parallelism")
        _require(m.expert_parallel == 1 or m.pipeline_parallel == 1,
                 f"backend megatron: expert_parallel {m.expert_parallel} with pipeline_parallel "
                 f"{m.pipeline_parallel} cannot start: the actor orders ranks tp-ep-pp-dp so each data-parallel "
                 f"replica is TP x PP consecutive actors (OpenRLHF's duplicate actors), and in that order "
                 f"megatron-core asserts the attention and expert layers have the same data-parallel size, which "
                 f"EP > 1 under PP > 1 breaks (parallel_state.initialize_model_parallel); use pipeline_parallel 1 "
                 f"and a larger expert_parallel (docs/megatron.md, 'Mixture of experts')")
        _require(m.expert_parallel == 1 or m.moe.dispatcher == "alltoall",
                 "backend megatron: megatron.moe.dispatcher allgather gathers equal token counts from every "
                 "expert-parallel rank, and the actor's micro-batches differ in length across ranks: use alltoall")
        _require(m.moe.routing_replay == "off" or not (m.recompute and m.pipeline_parallel > 1),
                 "backend megatron: megatron.moe.routing_replay: r3 with megatron.recompute under pipeline_parallel > 1 "
                 "is not supported (a recomputed forward would replay a later micro-batch's routes): turn off one")
        _require(not o.packing_samples or m.attention == "flash" or m.layer_spec == "te",
                 "backend megatron: openrlhf.packing_samples (packed THD micro-batches) needs megatron.attention: "
                 "flash; Megatron's local DotProductAttention refuses packed sequences")
        _require(o.ring_attn_size == 1, "backend megatron: openrlhf.ring_attn_size must be 1 (no context parallelism)")
        _require(not o.dynamic_batch or m.attention == "flash" or m.layer_spec == "te",
                 "backend megatron: openrlhf.dynamic_batch (token-budget micro-batches) needs megatron.attention: "
                 "flash; Megatron's local attention runs fixed-shape, masked micro-batches")
        _require(not o.colocate_all,
                 "backend megatron: openrlhf.colocate_all must be false: the Megatron actor has no sleep mode, and a "
                 "colocated vLLM engine would join OpenRLHF's NCCL weight-sync group from the actor's own GPU, which "
                 "NCCL refuses (two ranks on one device); give the engines their own GPUs")

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(_asdict(self))


def _asdict(obj: Any) -> Any:
    """``dataclasses.asdict`` with each field under its config key (field metadata "key")."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.metadata.get("key", f.name): _asdict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: _asdict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_asdict(x) for x in obj]
    return obj


def _to_plain(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _to_plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_to_plain(x) for x in v]
    return v


# what a config section is as plain data (dicts, lists): a checkpoint's record of it
to_plain = _to_plain


# ------------------------------------------------------------------ loading
def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{key}: bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}: expected a mapping, got {value!r}")
        return from_dict(tp, value, key)
    if origin in (Mapping, dict, collections.abc.Mapping) or tp is Mapping:
        if not isinstance(value, Mapping):
            raise ValueError(f"{key}: expected a mapping (e.g. {{alpha: 0.2}}), got {value!r}")
        return value
    if tp is Any:
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {value!r}")
        return tuple(_coerce(v, args[0], key) for v in value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads "1e-4" as a string; accept it explicitly
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{key}: expected a number, got {value!r}") from None
        if not math.isfinite(value):  # no config number means anything at inf or NaN
            raise ValueError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {value!r}")
        return value
    return value


# the modes of each "off | ..." switch, named when a config says `on`
ON_MODES = {"routing_replay": "r3", "level": "token or seq"}


def from_dict(cls, data: Mapping[str, Any], prefix: str = ""):
    """Build dataclass ``cls`` from ``data``; unknown keys raise naming the dotted key."""
    hints = typing.get_type_hints(cls)
    # a field whose config key is a Python keyword carries it as metadata (openrlhf.async -> async_)
    field_of = {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(cls)}
    names = list(field_of)
    # an "off | ..." switch: YAML 1.1 reads a bare `off` as false (`routing_replay: off`)
    offs = {f.name for f in dataclasses.fields(cls) if f.default == "off"}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in field_of:
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else ""
            raise ValueError(f"unknown config key {key!r}{hint}")
        if v is False and field_of[k] in offs:
            v = "off"
        elif v is True and field_of[k] in offs:  # `on` / `true` / `yes`: which "on" is meant is the user's to say
            modes = ON_MODES.get(field_of[k], "a named mode")
            raise ValueError(f"{key}: YAML reads a bare on / true / yes as true, and this switch is off or "
                             f"{modes}: write {modes}, or off")
        kwargs[field_of[k]] = _coerce(v, hints[field_of[k]], key)
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"invalid config{' section ' + repr(prefix) if prefix else ''}: {e}") from None


# the typed config per transported dict: each process rebuilds it once (``transported``)
_TRANSPORTED: dict[int, tuple[Mapping[str, Any], RunConfig]] = {}


def transported(data: Mapping[str, Any]) -> RunConfig:
    """The typed :class:`RunConfig` from the plain dict that carries it across the Ray boundary
    (``RunConfig.to_dict()``, OpenRLHF's ``args.hapo``): validated again, and rebuilt once per process
    and dict. Every actor and the controller read typed fields from it; the dict is only transport."""
    hit = _TRANSPORTED.get(id(data))
    if hit is None or hit[0] is not data:
        hit = (data, from_dict(RunConfig, data))
        _TRANSPORTED[id(data)] = hit
    return hit[1]


def load_yaml(text: str, what: str) -> Any:
    """``yaml.safe_load`` without aliases: an alias (``*name``) refers back to an anchor, and
    nested ones expand exponentially (a few hundred bytes of "billion laughs" take minutes of
    CPU and gigabytes in ``safe_load``). No hapo config needs them, so any alias is refused
    before the document is built, naming ``what`` (the file or the ``--set`` key)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when PyYAML has it: ~10x faster
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.AliasEvent):
            raise ValueError(f"{what}: YAML aliases (*{event.anchor}) are not allowed in hapo configs; write the "
                             f"value out")
    return yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader (SafeLoader or its C twin)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``["trainer.steps=5", "algorithm.estimator=grpo"]`` applied to a raw dict (YAML values)."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value")
        path, val = item.split("=", 1)
        node = raw
        parts = path.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {p!r} is not a section")
        try:
            node[parts[-1]] = load_yaml(val, f"--set {path.strip()}")
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ValueError(f"--set {path.strip()}: {val!r} is not a YAML value ({problem}); quote it, "
                             f"e.g. --set '{path.strip()}=\"...\"'") from None
    return raw


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: sections merge key by key; any other value replaces the base's."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict) and k not in _OPAQUE:
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


# free-form parameter maps are replaced whole, never merged (params of another algorithm
# would otherwise leak in and be rejected)
_OPAQUE = ("estimator_params", "loss_params")


# a ``base:`` chain longer than this is a mistake (a generated loop of files), not a config
MAX_BASE_DEPTH = 32


def read_raw(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The YAML mapping at ``path`` with its ``base:`` chain (relative paths) merged in. Each
    file is read bounded (a regular UTF-8 file of at most 16 MiB: ``jsonfile.read_small_text``),
    and the chain may be at most ``MAX_BASE_DEPTH`` files deep."""
    from .rundir.jsonfile import read_small_text

    chain: list[dict[str, Any]] = []
    p, shown = Path(path), str(path)
    seen = list(_seen)
    while True:
        p = p.resolve()
        if p in seen:
            raise ValueError(f"config base cycle: {' -> '.join(str(s) for s in (*seen, p))}")
        if len(seen) >= MAX_BASE_DEPTH:
            raise ValueError(f"config file {shown!r}: its base: chain is more than {MAX_BASE_DEPTH} files deep "
                             f"(from {str(seen[0])!r}); flatten it")
        if not p.exists():
            raise ValueError(f"config file {shown!r} not found")
        text = read_small_text(p, f"config file {shown!r}" if shown != str(p) else "config file")
        try:
            raw = load_yaml(text, f"config file {shown!r}") or {}
        except yaml.YAMLError as e:
            raise ValueError(f"config file {shown!r} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"config file {shown!r} must hold a mapping at the top level")
        seen.append(p)
        base = raw.pop("base", None)
        chain.append(raw)
        if base is None:
            break
        if not isinstance(base, str) or not base.strip():
            raise ValueError(f"config file {shown!r}: base must be a file name (a string), got {base!r}")
        p, shown = p.parent / base, str(p.parent / base)
    out: dict[str, Any] = {}
    for raw in reversed(chain):
        out = _merge(out, raw)
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load a run config: ``base:`` chain, then ``--set`` overrides, then validation."""
    raw = read_raw(path)
    if not raw:
        raise ValueError(f"config file {str(path)!r} is empty: a run config names at least its run "
                         f"(start from configs/cpu_tiny.yaml, or use `base: cpu_tiny.yaml`)")
    return from_dict(RunConfig, apply_overrides(raw, list(overrides or [])))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
