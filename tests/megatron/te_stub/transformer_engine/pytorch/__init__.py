"""transformer_engine.pytorch (stand-in; the package docstring of ``transformer_engine``)."""

from . import ops, optimizers  # noqa: F401
from .attention import DotProductAttention  # noqa: F401
from .distributed import CudaRNGStatesTracker, checkpoint  # noqa: F401
from .fp8 import fp8_autocast  # noqa: F401
from .module import Fp8Padding, Fp8Unpadding, GroupedLinear, LayerNorm, LayerNormLinear, Linear, RMSNorm  # noqa: F401
