"""The Megatron actor's start-up, one function per stage: the parallel state, this rank's
``GPTModel`` stage, and its weights from a Hugging Face checkpoint.

The policy actor (``integrations/openrlhf/actors/megatron_actor.py``), its KL reference and the
full-size dry run (:mod:`.dryrun`, ``hapo doctor --config``) call these same functions, so
a layout the dry run starts is a layout the actor starts. The caller has initialised
``torch.distributed``; megatron-core is imported lazily (the ``megatron`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch

if TYPE_CHECKING:
    from ..config import MegatronConfig

# tp-cp-ep-pp-dp: a data-parallel replica is TP x CP x PP consecutive ranks, which is how OpenRLHF's
# controller deals out data (its "duplicate actors": every CP rank gets the whole micro-batch and
# keeps its share, context_parallel.CPRows); expert parallelism is carved out of data
# parallelism. In this order megatron-core asserts that attention and expert layers have the same
# data-parallel size when PP > 1, which EP > 1 breaks, and CP > 1 too (its expert grid folds CP into
# data parallelism): the config loader refuses PP > 1 with EP > 1 or CP > 1.
RANK_ORDER = "tp-cp-ep-pp-dp"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Ranks:
    """This rank's place in the layout (megatron-core's parallel state after :func:`init_parallel_state`)."""

    tp: int
    pp: int
    ep: int
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_size: int  # data-parallel replicas (CP peers are one replica: they hold the same data)
    dp_rank: int
    expert_dp_size: int
    cp: int = 1
    cp_rank: int = 0

    @property
    def dp_cp_size(self) -> int:
        """What megatron-core's DDP reduces gradients over and its distributed optimizer shards over."""
        return self.dp_size * self.cp


def init_parallel_state(tp: int, pp: int, ep: int = 1, cp: int = 1) -> Ranks:
    """megatron-core's parallel state for TP x CP x PP x EP over the initialised world, in
    :data:`RANK_ORDER` (collective)."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp, expert_model_parallel_size=ep, order=RANK_ORDER)
    return Ranks(tp=tp, pp=pp, ep=ep, tp_rank=ps.get_tensor_model_parallel_rank(),
                 pp_rank=ps.get_pipeline_model_parallel_rank(), ep_rank=ps.get_expert_model_parallel_rank(),
                 dp_size=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                 expert_dp_size=ps.get_expert_data_parallel_world_size(), cp=cp,
                 cp_rank=ps.get_context_parallel_rank())


def moe_settings(hf_config, m: MegatronConfig) -> dict[str, Any] | None:
    """``megatron.moe`` as ``build_gpt_model``'s router / dispatcher settings (None: a dense model)."""
    from .families import family_of

    if not family_of(hf_config).moe:
        return None
    return {"dispatcher": m.moe.dispatcher, "aux_loss_coeff": float(m.moe.aux_loss_coeff)}


def build_stage(hf_config, m: MegatronConfig, ranks: Ranks, *, routing_replay: bool = False, cuda: bool):
    """This rank's ``GPTModel`` stage for the ``megatron`` config section ``m``, parameters
    uninitialised (weights are loaded next, :func:`load_hf_weights`): created on the device in
    ``params_dtype`` with ``cuda``, else on the CPU -- or on whatever ``torch.device`` context
    the caller holds (the dry run's ``meta``)."""
    from .model import build_gpt_model

    overrides = {"recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1} if m.recompute else {}
    overrides.update(perform_initialization=False, use_cpu_initialization=not cuda,
                     sequence_parallel=m.sequence_parallel)
    if ranks.cp > 1:  # TE's attention takes the CP group from the parallel state, the comm type from here
        overrides.update(context_parallel_size=ranks.cp, cp_comm_type=m.cp_comm_type)
    return build_gpt_model(hf_config, tp=ranks.tp, pp=ranks.pp, pp_rank=ranks.pp_rank,
                           params_dtype=DTYPES[m.params_dtype], vocab_multiple=m.vocab_multiple,
                           attention=m.attention, spec=m.layer_spec, head=m.head, ep=ranks.ep,
                           moe=moe_settings(hf_config, m), freeze_router=m.moe.freeze_router,
                           routing_replay=routing_replay, **overrides)


def load_hf_weights(model, source: Mapping[str, torch.Tensor], hf_config, m: MegatronConfig, ranks: Ranks,
                    what: str) -> None:
    """Fill ``model`` with this rank's shard of the Hugging Face state ``source`` (a lazy
    name -> tensor mapping; the dry run's holds meta tensors of the checkpoint's shapes). Any
    parameter left unfilled, any name the model lacks and any shape that differs is refused,
    naming ``what`` (the checkpoint)."""
    from .convert import hf_to_megatron

    weights = hf_to_megatron(source, hf_config, tp=ranks.tp, tp_rank=ranks.tp_rank, pp=ranks.pp,
                             pp_rank=ranks.pp_rank, vocab_multiple=m.vocab_multiple,
                             spec=m.layer_spec, ep=ranks.ep, ep_rank=ranks.ep_rank)
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # a shape mismatch: torch lists every one
        raise ValueError(f"{what}: Hugging Face weights do not fit the Megatron model: {e}") from None
    del weights
    bad = [k for k in missing if not k.endswith("_extra_state")] + list(unexpected)
    if bad:
        raise ValueError(f"{what}: Hugging Face weights do not fill the Megatron model: {bad[:5]}")
