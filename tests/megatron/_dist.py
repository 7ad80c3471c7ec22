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
           "hapo_openrlhf.integrations.openrlhf.actors.megatron_actor"]


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


def init_megatron(tp: int = 1, pp: int = 1, seed: int = 7, ep: int = 1) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from .cuda_shim import install

    install()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def load_hf_into(model, hf, **layout) -> None:
    """Load a Hugging Face model's weights into this rank's GPTModel stage (strict but for
    Megatron's ``_extra_state`` entries); ``layout``: ``hf_to_megatron``'s keywords (``spec``)."""
    from hapo_openrlhf.megatron.convert import hf_to_megatron

    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.state_dict(), hf.config, **layout), strict=False)
    assert unexpected == [] and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)


# the Transformer Engine stand-in package (te_stub/transformer_engine): only fresh interpreters can
# take it -- megatron-core decides at import whether TE is there, and the fork server has imported it
TE_STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "te_stub")


def _te_entry(rank, target, world, store, args):
    import importlib
    import sys
    from datetime import timedelta

    # the arguments were unpickled before this runs: they must not have imported megatron-core
    assert "megatron.core" not in sys.modules, "megatron-core was imported before the TE stand-in"
    sys.path.insert(0, TE_STUB)
    import transformer_engine  # noqa: F401  (the stand-in, before megatron-core looks for it)

    assert transformer_engine.__file__.startswith(TE_STUB), transformer_engine.__file__
    module, name = target.split(":")
    worker = getattr(importlib.import_module(module), name)
    if store is None:  # the worker brings up its own process group (the Megatron actor does)
        worker(rank, *args)
        return
    # a rank that stops on an error must not leave the other waiting out gloo's 30 minutes
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=5))
    try:
        worker(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn_te(target: str, nprocs: int, *args, process_group: bool = True) -> None:
    """Run ``module:function`` (``function(rank, *args)``) on ``nprocs`` gloo ranks started as
    fresh interpreters (``spawn``) with the Transformer Engine stand-in importable, so that
    megatron-core builds on it as it builds on an installed TE. The worker is named, not
    passed: unpickling a function would import its module, and with it megatron-core, before
    the stand-in is on the path. ``process_group=False``: the worker starts its own."""
    with tempfile.TemporaryDirectory(prefix="hapo-gloo-te-") as d:
        store = os.path.join(d, "store") if process_group else None
        mp.start_processes(_te_entry, args=(target, nprocs, store, args), nprocs=nprocs, join=True,
                           start_method="spawn")


def replace_model_parallel(tp: int = 1, pp: int = 1, seed: int = 7) -> None:
    """Tear down Megatron's parallel state (and its RNG tracker) and bring it up again under
    another layout, in the same processes."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.destroy_model_parallel()
    tensor_parallel.get_cuda_rng_tracker().reset()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
