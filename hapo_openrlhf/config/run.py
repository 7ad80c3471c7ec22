"""The whole run: every section, and the checks that span sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .algorithm import AlgorithmConfig
from .base import asdict_deep, choices, require, to_plain
from .megatron import MegatronConfig
from .model_data import DataConfig, ModelConfig, WarmupConfig
from .openrlhf import OpenRLHFConfig
from .prm import PRMConfig
from .rollout import RolloutConfig
from .slurm import SlurmConfig
from .training import EvalConfig, OptimConfig, TrainerConfig


@dataclass(frozen=True)
class RunConfig:
    run_name: str = "run"
    seed: int = 1234
    output_dir: str = "runs/run"
    backend: Literal["local", "openrlhf", "megatron"] = "local"
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
    prm: PRMConfig = field(default_factory=PRMConfig)  # read where the estimator trains_prm (PRIME)

    def __post_init__(self):
        require(0 <= self.seed < 2**32 - 100, f"seed must be an integer in [0, 2^32 - 100) (numpy's seed range, less "
                                               f"the offsets the trainer adds), got {self.seed}")
        require(self.backend in choices(type(self), "backend"), f"backend must be local, openrlhf or megatron, got {self.backend!r}")
        require(bool(str(self.output_dir).strip()), "output_dir must not be empty (it would write into the current "
                                                      "directory); name a run directory")
        require(bool(str(self.run_name).strip()) and "\n" not in str(self.run_name), "run_name must be one non-empty line")
        if self.backend == "local" and not self.model.path:
            from ..data.templates import TEMPLATES

            # the tiny model's byte positions must hold a templated prompt + the response (a lower bound
            # for synthetic prompts; real prompts are checked as they are tokenized)
            syn = self.data.synthetic
            prompt = len(TEMPLATES[self.data.template].format(problem="")) + syn.n_terms * (syn.digits + 3)
            need = max(self.rollout.max_new_tokens, self.eval.max_new_tokens) + prompt
            require(self.model.max_position_embeddings >= need,
                     f"model.max_position_embeddings ({self.model.max_position_embeddings}) is smaller than prompt + "
                     f"response (>= {need} tokens: max_new_tokens {need - prompt} + a ~{prompt}-token prompt)")
        if self.backend == "megatron":
            self._check_megatron()
        if self.backend != "local":
            require(not self.algorithm.accuracy_filter.enable,
                    f"algorithm.accuracy_filter runs in the embedded trainer (backend local); backend {self.backend} "
                    f"filters with algorithm.dynamic_sampling")
        require(self.backend == "local" or self.trainer.entropy_change_every <= 1,
                f"trainer.entropy_change_every: {self.trainer.entropy_change_every} sets how often the embedded trainer "
                f"(backend local) re-scores a step's tokens after its update; backend {self.backend} does not re-score "
                "(no actor/entropy_after or quadrant/Q/entropy_delta, docs/openrlhf.md): leave it at 1, or 0")
        require(self.backend == "local" or self.rollout.old_logprobs != "sampler",
                 f"rollout.old_logprobs: sampler is the embedded trainer's (backend local); backend {self.backend} "
                 "recomputes old log-probs with the actor, as OpenRLHF does: set rollout.old_logprobs: auto or forward "
                 "(vLLM's own log-probs enter through algorithm.is_correction)")

    @property
    def trains_prm(self) -> bool:
        """The estimator trains an implicit process reward model beside the policy (PRIME: ``prm``)."""
        from ..algos import ESTIMATORS

        return ESTIMATORS.get(self.algorithm.estimator).trains_prm

    @property
    def routing_replay(self) -> bool:
        """Rollout routing replay is on: the Megatron actor replays the rollout's routed experts."""
        return self.backend == "megatron" and self.megatron.moe.routing_replay == "r3"

    def _check_megatron(self) -> None:
        o, m = self.openrlhf, self.megatron
        world = o.actor_num_nodes * o.actor_gpus_per_node
        require(world % m.model_parallel_size == 0,
                 f"backend megatron: tensor_parallel x context_parallel x pipeline_parallel ({m.tensor_parallel} x "
                 f"{m.context_parallel} x {m.pipeline_parallel} = {m.model_parallel_size}) must divide the "
                 f"actor world size (openrlhf.actor_num_nodes x actor_gpus_per_node = {world})")
        dp = world // m.model_parallel_size
        require(dp * m.context_parallel % m.expert_parallel == 0,
                 f"backend megatron: expert_parallel {m.expert_parallel} must divide the data-parallel size "
                 f"x context_parallel {dp * m.context_parallel} "
                 f"(world {world} / tensor_parallel {m.tensor_parallel} / pipeline_parallel {m.pipeline_parallel}): "
                 f"expert parallelism is carved out of data (and context) parallelism")
        require(m.expert_parallel == 1 or m.pipeline_parallel == 1,
                 f"backend megatron: expert_parallel {m.expert_parallel} with pipeline_parallel "
                 f"{m.pipeline_parallel} cannot start: the actor orders ranks tp-ep-pp-dp so each data-parallel "
                 f"replica is TP x PP consecutive actors (OpenRLHF's duplicate actors), and in that order "
                 f"megatron-core asserts the attention and expert layers have the same data-parallel size, which "
                 f"EP > 1 under PP > 1 breaks (parallel_state.initialize_model_parallel); use pipeline_parallel 1 "
                 f"and a larger expert_parallel (docs/megatron.md, 'Mixture of experts')")
        require(m.expert_parallel == 1 or m.moe.dispatcher == "alltoall",
                 "backend megatron: megatron.moe.dispatcher allgather gathers equal token counts from every "
                 "expert-parallel rank, and the actor's micro-batches differ in length across ranks: use alltoall")
        require(m.moe.routing_replay == "off" or not (m.recompute and m.pipeline_parallel > 1),
                 "backend megatron: megatron.moe.routing_replay: r3 with megatron.recompute under pipeline_parallel > 1 "
                 "is not supported (a recomputed forward would replay a later micro-batch's routes): turn off one")
        require(not o.packing_samples or m.attention == "flash" or m.layer_spec == "te",
                 "backend megatron: openrlhf.packing_samples (packed THD micro-batches) needs megatron.attention: "
                 "flash; Megatron's local DotProductAttention refuses packed sequences")
        require(o.ring_attn_size == 1, "backend megatron: openrlhf.ring_attn_size must be 1 (DeepSpeed's ring attention; "
                                       "the Megatron actor's context parallelism is megatron.context_parallel)")
        require(m.context_parallel == 1 or o.packing_samples,
                 "backend megatron: megatron.context_parallel > 1 needs openrlhf.packing_samples: true (Transformer "
                 "Engine splits packed THD sequences over the CP ranks; padded rows are not split)")
        require(not o.dynamic_batch or m.attention == "flash" or m.layer_spec == "te",
                 "backend megatron: openrlhf.dynamic_batch (token-budget micro-batches) needs megatron.attention: "
                 "flash; Megatron's local attention runs fixed-shape, masked micro-batches")
        require(not o.colocate_all,
                 "backend megatron: openrlhf.colocate_all must be false: the Megatron actor has no sleep mode, and a "
                 "colocated vLLM engine would join OpenRLHF's NCCL weight-sync group from the actor's own GPU, which "
                 "NCCL refuses (two ranks on one device); give the engines their own GPUs")

    def to_dict(self) -> dict[str, Any]:
        return to_plain(asdict_deep(self))
