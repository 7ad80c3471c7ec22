"""transformer_engine.pytorch.router (stand-in): the fused MoE router kernels megatron-core
imports by name (used only with ``moe_router_fusion``); calling one is refused."""


def _refused(*args, **kwargs):
    raise NotImplementedError("the Transformer Engine stand-in has no fused router kernels (moe_router_fusion: off)")


fused_topk_with_score_function = fused_compute_score_for_moe_aux_loss = fused_moe_aux_loss = _refused
