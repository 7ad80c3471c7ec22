"""The CPU shim megatron-core 0.16.1 needs to run on gloo without CUDA (test-only;
every line is listed in docs/megatron.md). Nothing else is patched: the model,
tensor-parallel layers and their collectives are megatron-core's own."""

import types

import torch


def install() -> None:
    # parameters and RNG trackers ask for "the current CUDA device"
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    # tied embeddings with PP > 1: the last stage's copy is moved with weight.data.cuda()
    torch.Tensor.cuda = lambda self, *a, **k: self
    # model_parallel_cuda_manual_seed / CudaRNGStatesTracker keep CUDA generator states:
    # point them at the CPU generator (dropout is 0 in the tests, so no stream is consumed)
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # the pipeline schedules allocate their token counter with device="cuda"
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchWithCpuForCuda("torch")


class _TorchWithCpuForCuda(types.ModuleType):
    """``torch`` for one module's namespace, with ``zeros(..., device="cuda")`` on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)
