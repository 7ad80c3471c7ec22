"""The CPU shim megatron-core 0.16.1 - 0.19.x needs to run on gloo without CUDA (test-only;
every line is listed in docs/megatron.md). Nothing else is patched: the model,
tensor-parallel layers and their collectives are megatron-core's own."""

import contextlib
import types

import torch

from hapo_openrlhf.megatron.meta_platform import NullStream as _NullStream
from hapo_openrlhf.megatron.meta_platform import torch_on


def install() -> None:
    # parameters and RNG trackers ask for "the current CUDA device"
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    # megatron-core 0.19's gradient sync waits on the current stream for CUDA-graph events
    # (param_and_grad_buffer.py start_grad_sync): a stream that has none to wait for
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    # megatron-core's all-to-all MoE token dispatcher copies its token counts to the host on a side
    # stream (token_dispatcher.py, cuda_dtoh_stream): on the CPU the copy is synchronous
    torch.cuda.Stream = _NullStream  # a class: modules imported later use it in annotations (Stream | None)
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
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

    schedules.torch = torch_on("cpu")
    # the distributed optimizer: its base class and the grad-norm code build scalars with
    # device="cuda" (optimizer.py: found_inf, _dummy_overflow_buf, _scale_one; clip_grads.py;
    # utils.py: local_multi_tensor_l2_norm, the fallback without Apex / Transformer Engine)
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    for mod in (optimizer, clip_grads, distrib_optimizer, utils):
        mod.torch = torch_on("cpu")
    # the MoE auxiliary-loss tracker's buffers (moe_utils.py, save_to_aux_losses_tracker)
    from megatron.core.transformer.moe import moe_utils

    moe_utils.torch = torch_on("cpu")
    # ... and hands its all-to-all the split sizes as numpy arrays only when they were on the GPU
    # (moe_utils.maybe_move_tensor_to_cpu): a CPU tensor of sizes is what gloo's binding refuses
    from megatron.core.transformer.moe import token_dispatcher

    real = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return real(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    # MoE at TP > 1 (expert tensor parallelism): the all-to-all dispatcher all-gathers and
    # reduce-scatters each expert-TP rank's tokens with uneven split sizes (mappings.py
    # _gather_along_first_dim / _reduce_scatter_along_first_dim with split sizes), which NCCL does
    # and gloo refuses ("invalid tensor size"): the same collectives over padded equal-size buffers
    from megatron.core.tensor_parallel import mappings

    mappings.torch = _TorchWithUnevenGloo("torch")
    # ... and accepts a parameter only if its type() is 'torch.cuda.{Float,Half,BFloat16}Tensor'
    # (distrib_optimizer.py _build_model_and_main_param_groups, optimizer.py, clip_grads.py)
    _type = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **k: (_type(self, *a, **k) if a or k
                                               else _type(self).replace("torch.", "torch.cuda.", 1))


class _UnevenGloo(types.ModuleType):
    """``torch.distributed`` for megatron-core's ``mappings`` module, with ``all_gather`` and
    ``reduce_scatter`` over first-dimension splits of different sizes (NCCL's behaviour) done on
    gloo: the gather pads every piece to the largest and cuts it back; the reduce-scatter
    all-reduces the whole input and keeps this rank's piece. Equal sizes take gloo's own call."""

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if all(t.shape == tensor.shape for t in tensor_list):
            return torch.distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        n = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((n, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        bufs = [torch.empty_like(padded) for _ in tensor_list]
        torch.distributed.all_gather(bufs, padded, group=group)
        for t, b in zip(tensor_list, bufs):
            t.copy_(b[: t.shape[0]])

    @staticmethod
    def reduce_scatter(output, input_list, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        flat = torch.cat([t.reshape(-1) for t in input_list])
        torch.distributed.all_reduce(flat, op=op, group=group)
        rank = torch.distributed.get_rank(group)
        start = sum(t.numel() for t in input_list[:rank])
        output.copy_(flat[start:start + output.numel()].view_as(output))


class _TorchWithUnevenGloo(types.ModuleType):
    """``torch`` for megatron-core's ``mappings`` module, its ``distributed`` the :class:`_UnevenGloo`."""

    distributed = _UnevenGloo("torch.distributed")

    def __getattr__(self, name):
        return getattr(torch, name)
