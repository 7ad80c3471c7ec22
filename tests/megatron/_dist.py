"""Multi-process gloo helpers for the Megatron tests: spawn N ranks of a worker and
bring up Megatron's parallel state on them (with the CPU shim)."""

import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, worker, world, store, args):
    # a file rendezvous, not a free TCP port picked in advance: under xdist another worker's
    # Ray, Slurm or gloo job can take that port between the pick and rank 0's bind
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        worker(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(worker, nprocs: int, *args) -> None:
    """Run ``worker(rank, *args)`` on ``nprocs`` gloo ranks (a module-level function)."""
    with tempfile.TemporaryDirectory(prefix="hapo-gloo-") as d:
        mp.spawn(_entry, args=(worker, nprocs, os.path.join(d, "store"), args), nprocs=nprocs, join=True)


def init_megatron(tp: int = 1, pp: int = 1, seed: int = 7) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from .cuda_shim import install

    install()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def load_hf_into(model, hf, **layout) -> None:
    """Load a Hugging Face Qwen2's weights into this rank's GPTModel stage (strict but for
    Megatron's ``_extra_state`` entries)."""
    from hapo_openrlhf.megatron.convert import hf_to_megatron

    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.state_dict(), hf.config, **layout), strict=False)
    assert unexpected == [] and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
