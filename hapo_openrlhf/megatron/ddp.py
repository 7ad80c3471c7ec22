"""Megatron-core's own ``DistributedDataParallel`` and optimizer for a GPTModel stage:
the Megatron actor's optimizer (``megatron.distributed_optimizer``,
``megatron.optimizer_sharding``; docs/megatron.md).

What they do:

* **Gradients** go into DDP's contiguous fp32 ``main_grad`` buffers
  (``grad_reduce_in_fp32``): Megatron's own hooks add each backward's ``param.grad``
  into them, so a step of many micro-batches accumulates in fp32 as before.
* **Data-parallel reduction**: with the distributed optimizer a reduce-scatter (each
  rank keeps the reduced gradient of its 1/DP shard of the buffer), else an all-reduce,
  then ``finalize_model_grads`` (tied embeddings across pipeline stages, sequence-parallel
  norms). hapo's losses divide by ``global count / dp_size`` and the model config sets
  ``calculate_per_token_loss`` (DDP then sums over DP), so the sum is scaled by 1/DP:
  the gradient of the whole step, as before.
* **Optimizer state**: fp32 master weights (for a bf16 model) and Adam's moments exist
  only for this rank's shard, 12 / DP bytes per parameter instead of 12; the grad norm
  and clipping are computed over the shards (squares summed over DP and model parallel
  groups), and after the step every rank all-gathers the updated bf16 parameters, so
  the model -- and the weight sync to vLLM and the final save -- sees full weights.
  Without the distributed optimizer (``megatron.distributed_optimizer: false``) the
  buffers are all-reduced and every rank holds the whole state (Megatron's
  mixed-precision optimizer), 12 bytes per parameter.
* Weight decay skips biases and 1-D (norm) weights (Megatron's ``_get_param_groups``),
  as OpenRLHF's DeepSpeed actor does (``get_optimizer_grouped_parameters``).

megatron-core is imported lazily (the ``megatron`` extra). On CPU / gloo it runs with the
test-only shim (tests/megatron/cuda_shim.py, whose lines docs/megatron.md lists);
overlapped reduction and parameter gathering need CUDA streams and are off here
(``hapo doctor --gpu-smoke`` runs one distributed-optimizer step on a GPU).
"""

from __future__ import annotations

from typing import Any

import torch

from ..algos.grad_guard import nonfinite_flags, norm_from_flags

# megatron.optimizer_sharding: how the distributed optimizer's state is checkpointed, and
# which layout changes a resume may make (megatron-core's DistributedOptimizer
# .sharded_state_dict; named explicitly: 0.19 deprecates the implicit default)
SHARDINGS = {
    # each rank writes its own buffer shards, in parallel: resume may change DP only
    "dp_reshardable": "data-parallel size only",
    # DP rank 0 gathers each TP x PP shard's state into per-parameter tensors: any layout
    "fully_reshardable": "any tensor, pipeline and data-parallel layout",
}


def keeps_step_per_parameter(optimizer) -> bool:
    """Whether ``optimizer`` counts Adam's step per parameter in its state (torch's Adam /
    AdamW, megatron-core's fallback without Apex or Transformer Engine), rather than per
    param group (Transformer Engine's and Apex's ``FusedAdam``)."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))


def use_distributed_optimizer(setting: bool | None, dp_size: int) -> bool:
    """``megatron.distributed_optimizer``: ``None`` (the default) means on when DP > 1."""
    return dp_size > 1 if setting is None else bool(setting)


def wrap(model, *, distributed_optimizer: bool, bucket_size: int | None = None, overlap_grad_reduce: bool = False):
    """``model`` (a GPTModel stage) inside Megatron's ``DistributedDataParallel`` with fp32
    gradient buffers; the buffers are reduced in :meth:`MegatronOptimizer.step`.
    ``overlap_grad_reduce`` starts each bucket's reduction during the backward of the step's
    *last* micro-batch instead: Megatron's schedule runs every other micro-batch under the
    wrapper's ``no_sync`` (``config.no_sync_func``, set here as Megatron's own training loop
    sets it). Without it each micro-batch's backward launches the reductions of partial
    gradients: at DP=2 with 2 then 3 micro-batches per step (as a token budget makes them)
    the second step's norm was 32% off (tests/megatron/test_ddp.py: overlap on == off).
    The actor runs without overlap; ``hapo doctor --gpu-smoke`` runs both and compares."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce, overlap_param_gather=False,
        use_distributed_optimizer=distributed_optimizer, check_for_nan_in_grad=False, bucket_size=bucket_size)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    ddp.config.no_sync_func = ddp.no_sync
    return ddp


class MegatronOptimizer:
    """Megatron's optimizer (``DistributedOptimizer`` when the DDP wrapper was built with
    ``distributed_optimizer``, else its mixed-precision optimizer) over one DDP-wrapped
    stage: AdamW, fp32 masters for a bf16 model, gradient clipping at ``clip_grad``
    (0: none). :attr:`torch_optimizers` are the torch AdamW instances underneath, for an
    LR scheduler. ``sharding`` (:data:`SHARDINGS`) is how the distributed optimizer's state
    is checkpointed; the replicated optimizer's state is saved per parameter, like the
    model, and reshards with it."""

    def __init__(self, ddp_model, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 clip_grad: float = 1.0, sharding: str = "dp_reshardable") -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        if sharding not in SHARDINGS:
            raise ValueError(f"megatron.optimizer_sharding must be one of {sorted(SHARDINGS)}, got {sharding!r}")
        self.sharding = sharding
        self.model = ddp_model
        dtype = ddp_model.module.config.params_dtype
        cfg = OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=weight_decay, adam_beta1=float(betas[0]),
            adam_beta2=float(betas[1]), adam_eps=eps, bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype,
            use_distributed_optimizer=ddp_model.ddp_config.use_distributed_optimizer,
            clip_grad=max(float(clip_grad), 0.0))
        self.optimizer = get_megatron_optimizer(cfg, [ddp_model])
        self.distributed = bool(ddp_model.ddp_config.use_distributed_optimizer)
        # Megatron's param groups carry wd_mult (0 for biases and 1-D weights) and lr_mult, which
        # only its own OptimizerParamScheduler applies; the torch groups start at the config's
        # weight_decay for every group. Apply them here (the LR schedule then scales each group's lr)
        for opt in self.torch_optimizers:
            for group in opt.param_groups:
                group["weight_decay"] = float(weight_decay) * float(group.get("wd_mult", 1.0))
                group["lr"] = float(lr) * float(group.get("lr_mult", 1.0))
        self.skipped = False  # whether the last step() skipped the update (a non-finite gradient)
        self.zero_grad()

    @property
    def checkpoint_format(self) -> str:
        """What a checkpoint of this optimizer holds: ``distributed/<sharding>`` or
        ``replicated`` (per-parameter state in model space)."""
        return f"distributed/{self.sharding}" if self.distributed else "replicated"

    @property
    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return [o.optimizer for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])]

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float:
        """Reduce the accumulated gradients (collective over DP and the embedding group),
        clip, step, gather the updated parameters; returns the grad norm before clipping.

        A non-finite gradient on any rank skips the update (``hapo_openrlhf/grad_guard.py``):
        megatron-core checks for inf/NaN only with a grad scaler, which bf16 and fp32 do not
        have, and its clipping does not clip at a NaN norm. The gradients are cleared; the
        weights, masters, moments and step counts are untouched; :attr:`skipped` is True and
        the norm returned is ``nan`` (a NaN anywhere) or ``inf``."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])
        dp = ps.get_data_parallel_world_size()
        if dp > 1:  # the losses are per-replica shares of the global mean: average, not sum
            self.model.scale_gradients(1.0 / dp)
        # every rank's whole fp32 grad buffer: its reduced shard (distributed optimizer) or the
        # reduced gradients, plus its own contribution elsewhere -- a non-finite reduced value
        # has a non-finite contribution on some rank. One 2-element all-reduce over every rank
        bad = norm_from_flags(nonfinite_flags(
            b.grad_data for b in self.model.buffers + self.model.expert_parallel_buffers))
        self.skipped = bad is not None
        if self.skipped:
            self.zero_grad()
            return bad
        ok, norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("Megatron's optimizer skipped the step (a non-finite gradient)")
        self.zero_grad()
        return float(norm) if norm is not None else 0.0

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds: Adam's moments and, for a bf16 model,
        the fp32 master weights (the distributed optimizer's shards, or whole)."""
        seen, total = set(), 0

        def add(t):
            nonlocal total
            if isinstance(t, torch.Tensor) and t.numel() > 1 and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()

        for opt in self.torch_optimizers:
            for state in opt.state.values():
                for v in state.values():
                    add(v)
            if any(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"]) and \
                    self.model.module.config.params_dtype != torch.float32:
                for g in opt.param_groups:
                    for p in g["params"]:
                        add(p)
        return total

    def sharded_state_dict(self, model_sharded_state_dict, *, is_loading: bool = False) -> dict[str, Any]:
        """The optimizer's sharded state for ``megatron.core.dist_checkpointing`` (the
        distributed optimizer's in :attr:`sharding`, named explicitly: megatron-core 0.19
        deprecates the implicit default)."""
        if is_loading:
            self._init_empty_state()
        metadata = {"distrib_optim_sharding_type": self.sharding} if self.distributed else None
        if self.distributed and self.sharding == "fully_reshardable":
            # gathered over gloo onto DP rank 0 only (megatron-core's memory-efficient exchange);
            # the default all-gathers the whole optimizer state onto every rank: three fp32 CPU
            # copies of every buffer per rank (84 GB of host memory per rank at 7B) plus GPU
            # receive buffers the size of a whole bucket per key (docs/megatron.md)
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
        return self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)

    def _init_empty_state(self) -> None:
        """Give a fresh optimizer zero moments (and, for torch's Adam, step 0) to load into.
        megatron-core with torch's AdamW (no Apex / Transformer Engine) reads one common
        ``step`` from the per-parameter state when it builds the state dict to load into
        (``DistributedOptimizer.state_dict``: ``assert len(steps) == 1``), and its
        ``init_state_fn`` sets none: before the first step that state is empty.
        Transformer Engine's ``FusedAdam`` (megatron-core's choice whenever TE imports)
        keeps the step in each param group, and its ``state_dict`` refuses any other
        per-parameter key (``KeyError('step')``): it gets the moments only."""
        for opt in self.torch_optimizers:
            per_param_step = keeps_step_per_parameter(opt)
            for group in opt.param_groups:
                for p in group["params"]:
                    if not opt.state[p]:
                        opt.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                        if per_param_step:
                            opt.state[p]["step"] = torch.zeros((), dtype=torch.float32)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict`.

        The distributed optimizer's part works around megatron-core 0.16.1 with torch's
        AdamW (no Apex / Transformer Engine, on GPUs without them too), whose per-parameter
        ``step`` is a state entry but not a buffer shard. Upstream's ``load_state_dict``
        hands one shared ``step`` tensor to every parameter; its tensor loaders then copy
        every state key from the checkpoint: ``dp_reshardable`` copies in the step this rank
        held before the load (0: Adam's bias correction restarts), ``fully_reshardable``
        finds no ``step`` in the checkpoint (``KeyError``). So the param groups (which carry
        the saved step) load first, ``step`` leaves the state while the shards load, and
        each parameter then gets its own tensor holding the saved step. Transformer Engine's
        ``FusedAdam`` keeps the step in the param groups alone (loaded with them) and must
        not get a per-parameter one (:func:`keeps_step_per_parameter`)."""
        if not self.distributed:
            self.optimizer.load_state_dict(state)
            return
        inners = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        states = [state] if len(inners) == 1 else [state[k] for k in sorted(state)]
        loaders = {"dp_reshardable": "load_parameter_state_from_dp_reshardable",
                   "fully_reshardable": "load_parameter_state_from_fully_reshardable"}
        for inner, st in zip(inners, states, strict=True):
            st = dict(st)
            param_state, kind = st.pop("param_state"), st.pop("param_state_sharding_type")
            if kind not in loaders:
                raise ValueError(f"the checkpoint's distributed optimizer state is {kind!r}, not one of {sorted(loaders)}")
            inner.load_state_dict(st)  # param groups (with Adam's step); no param_state: no tensors yet
            torch_opt = inner.optimizer
            for per_param in torch_opt.state.values():
                per_param.pop("step", None)
            # masters and moments of this rank's shard, written in place: with an fp32 model a master is a
            # view of the parameter itself (a leaf that requires grad), which autograd refuses to write outside
            # no_grad -- megatron-core's loader does not disable it (an fp32 resume stopped with "a view of a
            # leaf Variable that requires grad is being used in an in-place operation")
            with torch.no_grad():
                getattr(inner, loaders[kind])(param_state)
            if keeps_step_per_parameter(torch_opt):
                for group in torch_opt.param_groups:
                    for p in group["params"]:
                        torch_opt.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
