"""What differs between the megatron-core versions the project accepts (>=0.16.1,<0.20; CI
runs 0.16.1 and 0.19.2), in one place.

megatron-core 0.19 logs, on every ``GPTModel`` it builds, "GPTModel IS DEPRECATED ... use
``HybridModel``", and its ``TransformerConfig`` warns "full scope is deprecated" from its own
CUDA-graph defaults (hapo sets no CUDA-graph option). Neither is actionable for a user of
this project -- the migration is ours (docs/megatron.md, "megatron-core versions") -- so
:func:`quiet_known_notices` drops exactly those two messages, nothing else, before the
actor builds its model. Everything megatron-core says otherwise reaches the logs.

Checkpoints record the megatron-core that wrote them (``hapo_layout.json``);
:func:`check_checkpoint_version` refuses, by name and before any tensor is read, one
written by a version outside the supported range. Inside it, a checkpoint moves between
versions: 0.16.1 -> 0.19.2 is tested bitwise (tests/megatron/test_cross_version.py). Back is
not possible: from 0.19 megatron-core's ``dist_checkpointing.save`` writes the common state
(hapo's trainer state) into the torch_dist shards as a ``common_state`` object instead of
``common.pt``, which 0.16 - 0.18 read (checked in the 0.17.0 and 0.18.0 wheels); such a
checkpoint is refused by name under them, before any tensor is read.

megatron-core 0.16.1's MoE router, with ``moe_router_dtype`` set (hapo's fp32 router), calls
``moe_utils.te_general_gemm``, a name its module binds only when Transformer Engine imports:
without TE the first MoE forward stops with ``NameError``. 0.19 binds it to None without TE
(the torch fallback). :func:`fill_known_gaps` does what 0.19 does, on versions that lack it.
"""

from __future__ import annotations

import logging
import warnings
from importlib.metadata import PackageNotFoundError, version

# the megatron-core versions accepted: [lowest, first refused); the ones CI runs
SUPPORTED = ("0.16.1", "0.20")
TESTED = ("0.16.1", "0.19.2")
# what a checkpoint without a recorded version was written by: hapo pinned 0.16.1 until it recorded it
UNRECORDED = "0.16.1"
# the first megatron-core whose dist_checkpointing keeps the common state in the shards (no common.pt)
COMMON_IN_SHARDS = (0, 19)

# (logger name, the start of the message) megatron-core logs that hapo's users cannot act on
_LOGGED = (("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),)
# (message regex, module regex) of warnings.warn calls from megatron-core's own defaults
_WARNED = (("full scope is deprecated", r"megatron\.core\.transformer\.transformer_config"),)


class _DropNotice(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_known_notices() -> None:
    """Install the filters (idempotent)."""
    for name, prefix in _LOGGED:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) and f.prefix == prefix for f in log.filters):
            log.addFilter(_DropNotice(prefix))
    for message, module in _WARNED:
        warnings.filterwarnings("ignore", message=message, module=module)


def release(v: str) -> tuple[int, ...]:
    """``"0.19.2+abc"`` -> ``(0, 19, 2)``."""
    from packaging.version import Version

    return Version(v.split("+")[0]).release


def installed() -> str | None:
    """The installed megatron-core's version, from its metadata (``megatron.core.__version__``
    appends the git commit of whatever repository the package directory sits in)."""
    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return None


def supported(v: str) -> bool:
    return release(SUPPORTED[0]) <= release(v) < release(SUPPORTED[1])


def check_checkpoint_version(path, saved: str | None) -> None:
    """Refuse a checkpoint written by a megatron-core outside :data:`SUPPORTED`."""
    saved = saved or UNRECORDED
    if not isinstance(saved, str) or not saved:
        raise ValueError(f"checkpoint {str(path)!r}: its recorded megatron-core version {saved!r} is not a version")
    try:
        ok = supported(saved)
    except ValueError:
        raise ValueError(f"checkpoint {str(path)!r}: its recorded megatron-core version {saved!r} is not a "
                         f"version") from None
    if not ok:
        raise ValueError(
            f"checkpoint {str(path)!r} was written by megatron-core {saved}, outside the versions hapo resumes "
            f"from (>={SUPPORTED[0]},<{SUPPORTED[1]}; this process runs {installed()}): its sharded-state layout "
            f"is untested here; resume under megatron-core {saved} or start from its weights converted to "
            f"Hugging Face layout")
    here = installed()
    if here and release(here) < COMMON_IN_SHARDS <= release(saved):
        raise ValueError(
            f"checkpoint {str(path)!r} was written by megatron-core {saved}, which keeps the common state inside "
            f"the torch_dist shards (no common.pt); megatron-core {here} reads it only from common.pt: resume it "
            f"under megatron-core >={'.'.join(map(str, COMMON_IN_SHARDS))},<{SUPPORTED[1]} (a checkpoint moves up "
            f"across versions, not down)")


def fill_known_gaps() -> None:
    """Bind the names megatron-core < 0.19 leaves unbound without Transformer Engine to what
    0.19 binds them to (module docstring): ``moe_utils.te_general_gemm = None``. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def aux_loss_token_factor() -> str:
    """How megatron-core's router weights a micro-batch's load-balancing loss under
    ``calculate_per_token_loss`` (``TopKRouter.attach_and_log_load_balancing_loss``), read from its
    source: ``"local"`` -- x the rank's routed tokens (0.16: with sequence parallelism each TP
    rank's shard, summed over TP by the router weight's gradient all-reduce) -- or ``"tp_cp"`` --
    x the rank's routed tokens x the TP x CP group's size (0.19, which counts the step's tokens
    per TP rank in ``finalize_model_grads``): TP x CP times the former, which
    ``moe.scaled_aux_loss`` divides back out (hapo divides by the step's tokens itself)."""
    import inspect

    from megatron.core.transformer.moe.router import TopKRouter

    src = inspect.getsource(TopKRouter.attach_and_log_load_balancing_loss)
    return "tp_cp" if "tp_cp_group.size()" in src.split("calculate_per_token_loss", 1)[-1] else "local"
