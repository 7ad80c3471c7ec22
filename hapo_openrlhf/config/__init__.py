"""Run configuration: one YAML file per run, loaded into frozen dataclasses.

Unknown keys are errors naming the dotted key (with a close match when there is
one); ranges are checked in ``__post_init__``. A config is never edited after
validation: overrides (``--set a.b=1``) are applied to the raw dict first.

One module per component, its dataclasses with their validation next to them (as torchtitan
keeps its job config): ``model_data`` (model, data, warm-up), ``rollout``, ``algorithm``,
``training`` (optimizer, trainer, evaluation), ``openrlhf``, ``megatron``, ``slurm``, ``prm`` (PRIME's
implicit PRM), and ``run``
(the whole run and the checks across sections); ``loader`` reads YAML (``base:`` includes,
``--set`` overrides, coercion) and carries a config across Ray (``transported``); ``base`` is
what they share. Everything is importable from here.
"""

from .algorithm import BEHAVIOURS, AccuracyFilterConfig, AlgorithmConfig, ISCorrectionConfig, OverlongConfig  # noqa: F401
from .base import FrozenDict, asdict_deep, choices, freeze, require, to_plain  # noqa: F401
from .loader import (MAX_BASE_DEPTH, ON_MODES, _merge, apply_overrides, dump_config, from_dict,  # noqa: F401
                     load_config, load_yaml, read_raw, transported)
from .megatron import MegatronConfig, MegatronMoEConfig  # noqa: F401
from .model_data import (MAX_SYNTHETIC_PROBLEMS, TINY_ARCHITECTURE, DataConfig, ModelConfig,  # noqa: F401
                         SyntheticConfig, WarmupConfig)
from .openrlhf import OpenRLHFConfig  # noqa: F401
from .prm import PRMConfig  # noqa: F401
from .rollout import RolloutConfig  # noqa: F401
from .run import RunConfig  # noqa: F401
from .slurm import SlurmConfig  # noqa: F401
from .training import MAX_NEW_TOKENS, MAX_SAMPLES, EvalConfig, OptimConfig, TrainerConfig  # noqa: F401
