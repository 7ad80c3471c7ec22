"""transformer_engine.pytorch.distributed (stand-in): the names megatron-core imports at module
level, and the tensor-parallel collectives of TE's linear layers as autograd functions."""

from contextlib import contextmanager

import torch
import torch.distributed as dist


@contextmanager
def activation_recompute_forward(activation_recompute: bool = False, recompute_phase: bool = False):
    yield


def checkpoint(function, *args, **kwargs):
    raise NotImplementedError("the Transformer Engine stand-in has no TE checkpoint (megatron-core uses it "
                              "for fp8 recompute only)")


class CudaRNGStatesTracker:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the Transformer Engine stand-in has no TE RNG tracker "
                                  "(megatron-core's own is used: te_rng_tracker off)")


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _GatherFirstDim(torch.autograd.Function):
    """Sequence parallelism, column-parallel input: all-gather along the sequence (dim 0);
    backward: reduce-scatter of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = _size(group)
        out = x.new_empty((x.shape[0] * n, *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        n = _size(ctx.group)
        out = g.new_empty((g.shape[0] // n, *g.shape[1:]))
        dist.reduce_scatter_tensor(out, g.contiguous(), group=ctx.group)
        return out, None


class _ReduceScatterFirstDim(torch.autograd.Function):
    """Sequence parallelism, row-parallel output: reduce-scatter along dim 0; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = _size(group)
        out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        n = _size(ctx.group)
        out = g.new_empty((g.shape[0] * n, *g.shape[1:]))
        dist.all_gather_into_tensor(out, g.contiguous(), group=ctx.group)
        return out, None


class _AllReduce(torch.autograd.Function):
    """Row-parallel output without sequence parallelism: all-reduce; backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _AllReduceGrad(torch.autograd.Function):
    """Column-parallel input without sequence parallelism: identity; backward: all-reduce of
    the input gradient (each rank holds the part from its output columns)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def column_input(x, group, sequence_parallel: bool):
    if _size(group) == 1:
        return x
    return _GatherFirstDim.apply(x, group) if sequence_parallel else _AllReduceGrad.apply(x, group)


def row_output(y, group, sequence_parallel: bool):
    if _size(group) == 1:
        return y
    return _ReduceScatterFirstDim.apply(y, group) if sequence_parallel else _AllReduce.apply(y, group)
