"""transformer_engine.pytorch.ops (stand-in): the names megatron-core's TE extension
references at import (its op-fuser MLP); building any of them is refused."""

import torch


class FusibleOperation(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"the Transformer Engine stand-in has no op fuser ({type(self).__name__}); "
                                  f"use_te_op_fuser must stay off")


for _name in ("Sequential", "BasicOperation", "BasicLinear", "Bias", "LayerNorm", "RMSNorm", "SwiGLU", "GEGLU",
              "ReGLU", "GELU", "ReLU", "SiLU", "AllReduce", "ReduceScatter", "AllGather"):
    globals()[_name] = type(_name, (FusibleOperation,), {})
