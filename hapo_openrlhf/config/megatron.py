"""The Megatron-core policy actor: its parallel layout, dtype, spec, head, optimizer, and mixture of experts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .base import choices, require


@dataclass(frozen=True)
class MegatronMoEConfig:
    """Mixture-of-experts settings of the Megatron actor (a Qwen3-MoE model; docs/megatron.md,
    "Mixture of experts": where each default comes from). Ignored for a dense model, but
    ``routing_replay: r3`` on one is refused (``families.check_actor_family``)."""

    # megatron-core's token dispatcher (allgather needs equal token counts per EP rank)
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    aux_loss_coeff: float = 0.0  # the load-balancing loss (0: none, slime's RL default; moe.scaled_aux_loss)
    freeze_router: bool = False  # keep every router's weight at its checkpoint value
    # off | r3: replay the rollout's routed experts in the old-log-prob and training forwards (the engines
    # return them: vLLM with enable_return_routed_experts on GPUs; integrations/openrlhf/actors/routes.py)
    routing_replay: Literal["off", "r3"] = "off"

    def __post_init__(self):
        require(self.dispatcher in choices(type(self), "dispatcher"),
                 f"megatron.moe.dispatcher must be alltoall or allgather, got {self.dispatcher!r}")
        require(self.aux_loss_coeff >= 0, f"megatron.moe.aux_loss_coeff must be >= 0, got {self.aux_loss_coeff}")
        require(self.routing_replay in choices(type(self), "routing_replay"),
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
    # context parallelism: each packed sequence split over this many ranks (Transformer Engine's
    # context-parallel attention; needs layer_spec: te, openrlhf.packing_samples, pipeline_parallel 1;
    # megatron/context_parallel.py, docs/megatron.md "Context parallelism")
    context_parallel: int = 1
    # how TE's attention exchanges K/V between the CP ranks: p2p (ring, TE >= 1.7 on THD), all_gather
    # or a2a (TE >= 1.10; a2a: heads per TP rank divisible by CP). a2a+p2p (hierarchical) is refused:
    # TE runs it on sbhd / bshd only, and CP here is THD
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = "p2p"
    sequence_parallel: bool = False  # needs layer_spec: te (megatron-core's torch norms refuse it)
    params_dtype: Literal["bf16", "fp32"] = "bf16"  # bf16 | fp32 (weights, activations and the AdamW moments' params)
    vocab_multiple: int = 128  # the vocabulary is padded to a multiple of this x tensor_parallel
    recompute: bool = False  # full activation recomputation, every layer (the 24k memory lever)
    timeout_minutes: int = 60  # torch.distributed collectives
    # flash: hapo's FlashCoreAttention (flash-attn varlen / causal SDPA, packed or right-padded rows);
    # local: megatron-core's DotProductAttention ([S, S] scores and an explicit mask; for comparison)
    attention: Literal["flash", "local"] = "flash"
    # local: megatron-core's local spec (torch norms and linears; ``attention`` picks its core attention);
    # te: Transformer Engine's spec (fused norm + linear, TE's attention; needs transformer-engine on CUDA)
    layer_spec: Literal["local", "te"] = "local"
    # fused: log-probs and entropy from the hidden states and the head shard, chunk by chunk (no
    # [T, V/TP] logits; megatron/head.py); logits: Megatron's output layer, then the vocabulary-
    # parallel reductions (for comparison); auto: fused with attention: flash, logits with local
    head: Literal["auto", "fused", "logits"] = "auto"
    # Megatron's DistributedOptimizer (fp32 masters and Adam moments sharded over data parallelism,
    # megatron/ddp.py): null (default) = on when DP > 1; false = every rank holds the whole state
    distributed_optimizer: bool | None = None
    # how the distributed optimizer's state is checkpointed, and so which layout a resume may change:
    # dp_reshardable (each rank writes its shards in parallel; resume at another DP size only) or
    # fully_reshardable (gathered per parameter on save; resume under any TP x PP x DP)
    optimizer_sharding: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    # mixture of experts: expert-parallel ranks, carved out of data parallelism (each expert lives on
    # DP / expert_parallel replicas; expert tensor parallelism is TP), and the router settings
    expert_parallel: int = 1
    moe: MegatronMoEConfig = field(default_factory=MegatronMoEConfig)

    def __post_init__(self):
        require(self.tensor_parallel >= 1 and self.pipeline_parallel >= 1 and self.expert_parallel >= 1,
                 "megatron.tensor_parallel, pipeline_parallel and expert_parallel must be >= 1")
        require(self.attention in choices(type(self), "attention"), f"megatron.attention must be flash or local, got {self.attention!r}")
        require(self.layer_spec in choices(type(self), "layer_spec"), f"megatron.layer_spec must be local or te, got {self.layer_spec!r}")
        require(self.layer_spec != "te" or self.attention == "flash",
                 "megatron.attention: local is the local spec's DotProductAttention; with megatron.layer_spec: te "
                 "the core attention is Transformer Engine's (leave attention: flash, the default)")
        require(self.head in choices(type(self), "head"), f"megatron.head must be auto, fused or logits, got {self.head!r}")
        require(self.distributed_optimizer in (None, True, False),
                 f"megatron.distributed_optimizer must be true, false or null (on when DP > 1), "
                 f"got {self.distributed_optimizer!r}")
        require(self.optimizer_sharding in choices(type(self), "optimizer_sharding"),
                 f"megatron.optimizer_sharding must be dp_reshardable or fully_reshardable, "
                 f"got {self.optimizer_sharding!r}")
        require(isinstance(self.context_parallel, int) and not isinstance(self.context_parallel, bool)
                 and self.context_parallel >= 1,
                 f"megatron.context_parallel must be an integer >= 1, got {self.context_parallel!r}")
        require(self.cp_comm_type != "a2a+p2p",
                 "megatron.cp_comm_type a2a+p2p (hierarchical: a2a inside a node, p2p across) cannot run on packed "
                 "sequences: Transformer Engine asserts qkv_format != 'thd' for it (attn_forward_func_with_cp, "
                 "TE 1.12 to 2.x), and context parallelism here needs openrlhf.packing_samples (THD): use p2p, "
                 "all_gather or a2a")
        require(self.cp_comm_type in choices(type(self), "cp_comm_type"),
                 f"megatron.cp_comm_type must be p2p, all_gather or a2a, got {self.cp_comm_type!r}")
        require(self.context_parallel == 1 or self.layer_spec == "te",
                 "megatron.context_parallel > 1 needs megatron.layer_spec: te: megatron-core's local attention "
                 "asserts context_parallel_size 1, context parallelism runs through Transformer Engine's attention")
        require(self.context_parallel == 1 or self.pipeline_parallel == 1,
                 f"megatron.context_parallel {self.context_parallel} with pipeline_parallel {self.pipeline_parallel} "
                 f"cannot start: the actor orders ranks tp-cp-ep-pp-dp so each data-parallel replica is TP x CP x PP "
                 f"consecutive actors (OpenRLHF's duplicate actors), and in that order megatron-core asserts the "
                 f"attention and expert layers have the same data-parallel size, which its expert grid (CP folded "
                 f"into data parallelism) breaks under PP > 1 even for a dense model "
                 f"(parallel_state.initialize_model_parallel): use tensor and context parallelism with "
                 f"pipeline_parallel 1")
        require(not self.sequence_parallel or self.layer_spec == "te",
                 "megatron.sequence_parallel needs megatron.layer_spec: te (Transformer Engine's norms); "
                 "megatron-core's local spec builds torch norms, which refuse it (docs/megatron.md)")
        require(not self.sequence_parallel or self.tensor_parallel > 1,
                 "megatron.sequence_parallel splits tokens over tensor-parallel ranks: it needs tensor_parallel > 1")
        require(self.params_dtype in choices(type(self), "params_dtype"), f"megatron.params_dtype must be bf16 or fp32, got {self.params_dtype!r}")
        require(self.vocab_multiple >= 1 and self.timeout_minutes >= 1, "megatron.vocab_multiple and timeout_minutes must be >= 1")

    @property
    def model_parallel_size(self) -> int:
        """The ranks of one data-parallel replica (OpenRLHF's duplicate actors: they receive the same data)."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel
