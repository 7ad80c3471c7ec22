"""A CPU stand-in for Transformer Engine 2.20.2 (``transformer-engine`` on PyPI), for the
Megatron tests only -- never installed, put on ``sys.path`` by ``tests/megatron/_dist.py``
(``spawn_te``'s fork server, ``tests/megatron/_te_preload.py``) before megatron-core is imported.

TE needs CUDA, so it cannot be imported on the machines the suite runs on. What our code
depends on is the part of TE that megatron-core's TE layer spec
(``megatron/core/extensions/transformer_engine.py``) reaches, mirrored from the
2.20.2 wheel's Python source and implemented in torch:

* ``pytorch.Linear`` / ``pytorch.LayerNormLinear`` / ``pytorch.RMSNorm`` /
  ``pytorch.LayerNorm``: their constructors' parameter names and defaults, the parameter
  names and shapes they register (``weight``, ``bias``, ``layer_norm_weight``,
  ``layer_norm_bias``; a column-parallel weight holds ``out / tp`` rows, a row-parallel one
  ``in / tp`` columns), the attributes they set on them (``tensor_model_parallel``,
  ``partition_dim``, ``sequence_parallel``), their tensor-parallel communication (column:
  all-gather of the input over TP with sequence parallelism, else a gradient all-reduce;
  row: reduce-scatter with sequence parallelism, else all-reduce; a row-parallel bias added
  after the reduction), and ``get_extra_state`` (an empty uint8 tensor without fp8);
* ``pytorch.DotProductAttention``: its constructor and forward keywords, ``sbhd`` /
  ``bshd`` / ``thd`` layouts (``thd``: one sequence per ``cu_seqlens`` segment), the
  causal / padding mask types, grouped-query heads, output ``[..., heads * d]``;
* ``pytorch.optimizers.FusedAdam`` (``tests/megatron/te_standin.py``) and the module paths
  megatron-core imports at module level (``pytorch.fp8``, ``pytorch.distributed``,
  ``pytorch.tensor``, ``common.recipe``).

``tests/megatron/test_te_standin.py`` checks those names against the wheel's source. What
the stand-in cannot prove is listed in docs/megatron.md ("Transformer Engine"): TE's CUDA
kernels (cuDNN / flash attention, fused norms, GEMMs, userbuffer overlap), fp8 / fp4 and their
scaling state, TE's RNG tracker, ``fuse_wgrad_accumulation`` and the op fuser -- each refused
here by name when asked for. ``pytorch.GroupedLinear`` (grouped GEMM, megatron-core's
``TEGroupedMLP``) is mirrored with per-GEMM parameters, its kernel as a loop of GEMMs.
"""

__version__ = "2.20.2"

from . import common  # noqa: F401,E402  (TE's own __init__ imports it first)
