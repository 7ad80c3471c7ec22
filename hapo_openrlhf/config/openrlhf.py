"""The OpenRLHF back end: placement, batch sizes, vLLM, DeepSpeed, async."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .base import choices, require


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
    vllm_sync_backend: Literal["nccl", "gloo"] = "nccl"
    colocate_all: bool = True
    zero_stage: int = 2
    param_dtype: Literal["bf16", "fp16"] = "bf16"
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
        require(0 < self.vllm_gpu_memory_utilization <= 1,
                 f"openrlhf.vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}")
        require(self.actor_num_nodes >= 1 and self.actor_gpus_per_node >= 1, "openrlhf: actor nodes and GPUs must be >= 1")
        require(self.vllm_num_engines >= 1 and self.vllm_tensor_parallel_size >= 1,
                 "openrlhf.vllm_num_engines and vllm_tensor_parallel_size must be >= 1 (HAPO rollouts need an engine)")
        require(self.zero_stage in (0, 1, 2, 3), f"openrlhf.zero_stage must be 0-3, got {self.zero_stage}")
        require(self.param_dtype in choices(type(self), "param_dtype"), f"openrlhf.param_dtype must be bf16 or fp16, got {self.param_dtype!r}")
        # refused, not cast: the DeepSpeed actor's weight sync is OpenRLHF's own broadcast
        require(self.param_dtype != "fp16",
                 "openrlhf.param_dtype: fp16 cannot run: OpenRLHF 0.11.2 creates every vLLM engine with dtype "
                 "bfloat16 (trainer/ray/vllm_engine.py, create_vllm_engines) and its worker asserts that each synced "
                 "weight has the engine's dtype (trainer/ray/vllm_worker_wrap.py, update_weight), so an fp16 actor "
                 "fails at the first weight sync; use bf16")
        require(self.vllm_sync_backend in choices(type(self), "vllm_sync_backend"), "openrlhf.vllm_sync_backend must be nccl or gloo")
        require(self.ring_attn_size >= 1, "openrlhf.ring_attn_size must be >= 1")
        require(self.ring_attn_size == 1 or self.packing_samples, "openrlhf.ring_attn_size > 1 needs packing_samples: true")
        world = self.actor_num_nodes * self.actor_gpus_per_node
        require(world % self.ring_attn_size == 0,
                 f"openrlhf.ring_attn_size {self.ring_attn_size} must divide the actor world size {world}")
        require(self.max_len > 0 and self.train_batch_size > 0 and self.micro_train_batch_size > 0
                 and self.micro_rollout_batch_size > 0, "openrlhf: max_len and batch sizes must be > 0")
        require(self.max_tokens_per_gpu > 0, "openrlhf.max_tokens_per_gpu must be > 0")
        require(self.async_queue_size >= 1, "openrlhf.async_queue_size must be >= 1")
        require(not self.partial_rollout or self.async_, "openrlhf.partial_rollout needs openrlhf.async: true")
        require(not (self.async_ and self.colocate_all and self.vllm_enable_sleep),
                 "openrlhf.async: true cannot use vLLM's sleep mode (generation runs while the actor trains); set "
                 "openrlhf.vllm_enable_sleep: false and give the engines their own GPUs (colocate_all: false)")
        require(self.num_episodes >= 1, "openrlhf.num_episodes must be >= 1")
        require(0 <= self.lr_warmup_ratio < 1, "openrlhf.lr_warmup_ratio must be in [0, 1)")
