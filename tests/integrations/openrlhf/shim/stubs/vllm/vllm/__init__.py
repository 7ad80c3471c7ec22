"""TEST-ONLY stand-in for the names OpenRLHF 0.11.2 imports from vLLM at module level.

vLLM is a GPU package that is not installed on the CPU test machine, yet
``openrlhf.trainer.ppo_utils.samples_generator`` does ``from vllm import SamplingParams``
and ``openrlhf.trainer.ray.vllm_engine`` imports ``vllm``, ``vllm.inputs.TokensPrompt``
and ``vllm.utils.random_uuid`` when they are imported. This package is put on the path
only when the real vLLM is absent (see ``hapo_cpu_shim.stub_path``); the CPU rollout
engine reads the sampling parameters from ``SamplingParams``. Listed in docs/openrlhf.md.
"""

from dataclasses import dataclass
from typing import Any, Optional

__version__ = "0.29.0"


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logprobs: Optional[int] = None
    seed: Optional[int] = None


class AsyncEngineArgs:  # referenced, never constructed, on the CPU path
    def __init__(self, *a: Any, **k: Any) -> None:
        raise RuntimeError("vLLM is not installed (test stub)")
