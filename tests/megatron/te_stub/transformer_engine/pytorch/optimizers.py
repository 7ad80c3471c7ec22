"""transformer_engine.pytorch.optimizers (stand-in): TE's ``FusedAdam`` (fp32 states;
tests/megatron/te_standin.py). ``FusedSGD`` exists by name and refuses to be built; TE's
multi-tensor kernels are absent (megatron-core then uses its local fallbacks)."""

import torch

from tests.megatron.te_standin import FusedAdam  # noqa: F401


class FusedSGD(torch.optim.Optimizer):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the Transformer Engine stand-in has no FusedSGD")
