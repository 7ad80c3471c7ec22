"""transformer_engine.pytorch.fp8 (stand-in): fp8 is never enabled."""

from contextlib import contextmanager


class FP8GlobalStateManager:
    """The queries megatron-core makes outside fp8 training, answered as TE answers them
    with fp8 off."""

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return False

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return False

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        return False

    @classmethod
    def get_fp8_recipe(cls):
        return None

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return False


@contextmanager
def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe=None, fp8_group=None,
                 _graph: bool = False):
    if enabled or calibrating:
        raise NotImplementedError("the Transformer Engine stand-in has no fp8 (fp8: off)")
    yield


@contextmanager
def fp8_model_init(enabled: bool = True, recipe=None, preserve_high_precision_init_val: bool = False):
    if enabled:
        raise NotImplementedError("the Transformer Engine stand-in has no fp8 parameters (fp8: off)")
    yield
