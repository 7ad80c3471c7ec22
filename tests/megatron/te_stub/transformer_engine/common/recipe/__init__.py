"""transformer_engine.common.recipe (stand-in): the classes megatron-core subclasses at import
(``TEDelayedScaling``); fp8 recipes are refused when built."""

from enum import Enum


class Format(Enum):
    E4M3 = "E4M3"
    HYBRID = "HYBRID"
    E5M2 = "E5M2"


class Recipe:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the Transformer Engine stand-in has no fp8 / fp4 recipes (fp8: off)")


class DelayedScaling(Recipe):
    pass


class Float8CurrentScaling(Recipe):
    pass


class MXFP8BlockScaling(Recipe):
    pass


class Float8BlockScaling(Recipe):
    pass
