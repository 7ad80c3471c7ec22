"""transformer_engine.pytorch.tensor (stand-in): the base class megatron-core's fp8_utils
imports unconditionally when TE imports; no quantized tensor is ever made."""

import torch


class QuantizedTensor(torch.Tensor):
    def __new__(cls, *args, **kwargs):
        raise NotImplementedError("the Transformer Engine stand-in has no quantized tensors (fp8: off)")
