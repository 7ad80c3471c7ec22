"""Multi-process gloo helpers for the Megatron tests: spawn N ranks of a worker and
bring up Megatron's parallel state on them (with the CPU shim).

Ranks start from a fork server that has imported torch, transformers and megatron-core
once (``multiprocessing``'s ``forkserver`` with a preload list), not as fresh
interpreters: a fresh rank spent 6-10 s of CPU importing them (megatron-core alone
compiles ~40 ``torch.compile`` wrappers at import) against well under a second forked,
and the suite starts ~150 ranks (docs/performance.md, "Test suite"). The fork server
imports only; it starts no thread and no process group, so forking it is safe."""

import multiprocessing
import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

# what every rank imports; the fork server imports them before its first fork (a module
# that fails to import there is skipped by multiprocessing and imported by the rank itself)
PRELOAD = ["torch", "torch.distributed", "pytest", "transformers", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.llama.modeling_llama",
           "megatron.core", "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
           "hapo_openrlhf.megatron.model", "hapo_openrlhf.megatron.schedule", "tests.megatron.cuda_shim",
           # the Megatron policy actor's tests (OpenRLHF, DeepSpeed, Ray: imported, nothing started)
           "hapo_openrlhf.integrations.openrlhf.megatron_actor"]


def start_method() -> str:
    """``forkserver`` with :data:`PRELOAD` (set once per process, before its fork server starts)."""
    if not getattr(start_method, "_set", False):
        multiprocessing.set_forkserver_preload(PRELOAD)
        start_method._set = True
    return "forkserver"


def _entry(rank, worker, world, store, args):
    # a file rendezvous, not a free TCP port picked in advance: under xdist another worker's
    # Ray, Slurm or gloo job can take that port between the pick and rank 0's bind
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        worker(rank, *args)
    finally:
        dist.destroy_process_group()


def start(fn, nprocs: int, args: tuple) -> None:
    """``torch.multiprocessing.spawn``'s contract (``fn(rank, *args)`` on ``nprocs``
    processes, joined, a rank's exception re-raised) with ranks forked from the fork server."""
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method=start_method())


def spawn(worker, nprocs: int, *args) -> None:
    """Run ``worker(rank, *args)`` on ``nprocs`` gloo ranks (a module-level function)."""
    with tempfile.TemporaryDirectory(prefix="hapo-gloo-") as d:
        start(_entry, nprocs, (worker, nprocs, os.path.join(d, "store"), args))


def init_megatron(tp: int = 1, pp: int = 1, seed: int = 7) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from .cuda_shim import install

    install()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def load_hf_into(model, hf, **layout) -> None:
    """Load a Hugging Face model's weights into this rank's GPTModel stage (strict but for
    Megatron's ``_extra_state`` entries)."""
    from hapo_openrlhf.megatron.convert import hf_to_megatron

    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.state_dict(), hf.config, **layout), strict=False)
    assert unexpected == [] and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
