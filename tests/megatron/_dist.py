"""Multi-process gloo helpers for the Megatron tests: spawn N ranks of a worker and
bring up Megatron's parallel state on them (with the CPU shim).

Ranks start from a fork server that has imported torch, transformers and megatron-core
once (``multiprocessing``'s ``forkserver`` with a preload list), not as fresh
interpreters: a fresh rank spent 6-10 s of CPU importing them (megatron-core alone
compiles ~40 ``torch.compile`` wrappers at import) against well under a second forked,
and the suite starts ~150 ranks (docs/performance.md, "Test suite"). The fork server
imports only; it starts no thread and no process group, so forking it is safe. The ranks that
build on the Transformer Engine stand-in come from a second fork server of their own, which put
the stand-in on its path before importing megatron-core (:func:`spawn_te`)."""

import contextlib
import multiprocessing
import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp

# what every rank imports; the fork server imports them before its first fork. A module that fails to
# import there is skipped by multiprocessing without a word and imported by each rank itself, so the
# first entry puts the OpenRLHF tests' stubs on the server's path (which is the interpreter's default,
# not this process's: tests/integrations/openrlhf/stub_path.py), and a test checks that a rank finds
# every module preloaded (tests/megatron/test_fork_preload.py)
PRELOAD = ["tests.integrations.openrlhf.stub_path", "torch", "torch.distributed", "pytest", "transformers",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
           "transformers.models.llama.modeling_llama",
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


def init_megatron(tp: int = 1, pp: int = 1, seed: int = 7, ep: int = 1, cp: int = 1) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from .cuda_shim import install

    install()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def load_hf_into(model, hf, **layout) -> None:
    """Load a Hugging Face model's weights into this rank's GPTModel stage (strict but for
    Megatron's ``_extra_state`` entries); ``layout``: ``hf_to_megatron``'s keywords (``spec``)."""
    from hapo_openrlhf.megatron.convert import hf_to_megatron

    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.state_dict(), hf.config, **layout), strict=False)
    assert unexpected == [] and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)


# the Transformer Engine stand-in package (te_stub/transformer_engine): megatron-core decides at import
# whether TE is there, so ranks that must build on it cannot come from the fork server above (which
# imported megatron-core without it); they come from a second fork server that put the stand-in first
TE_STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "te_stub")
# what the TE fork server imports: the stand-in first (tests/megatron/_te_preload.py), then PRELOAD
TE_PRELOAD = ["tests.megatron._te_preload", *PRELOAD]
_te_server = None


def _te_fork_server():
    """The fork server of the TE ranks (one per process, started on first use): multiprocessing's own
    ``ForkServer`` class, a second instance beside the module's, with :data:`TE_PRELOAD`."""
    global _te_server
    if _te_server is None:
        from multiprocessing import forkserver

        _te_server = forkserver.ForkServer()
        _te_server.set_forkserver_preload(TE_PRELOAD)
    return _te_server


@contextlib.contextmanager
def _forked_from(server):
    """Processes started in this block come from ``server``: the forkserver ``Popen`` asks the
    module-level ``multiprocessing.forkserver.connect_to_new_process`` for each new process
    (``popen_forkserver.Popen._launch``, Python 3.11-3.12), pointed here at ``server``'s."""
    from multiprocessing import forkserver

    saved = forkserver.connect_to_new_process
    forkserver.connect_to_new_process = server.connect_to_new_process
    try:
        yield
    finally:
        forkserver.connect_to_new_process = saved


def _te_entry(rank, target, world, store, args):
    import importlib
    import sys
    from datetime import timedelta

    # a preload that fails is skipped by the fork server without a word: check the stand-in is what
    # megatron-core found (its TE extension imported with HAVE_TE)
    te = sys.modules.get("transformer_engine")
    assert te is not None and te.__file__.startswith(TE_STUB), getattr(te, "__file__", None)
    from megatron.core.extensions import transformer_engine as mc_te

    assert mc_te.HAVE_TE, "megatron-core did not find the Transformer Engine stand-in"
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
    """Run ``module:function`` (``function(rank, *args)``) on ``nprocs`` gloo ranks forked from the
    TE fork server, where megatron-core was imported with the Transformer Engine stand-in first on
    the path, so it builds on it as it builds on an installed TE (fresh interpreters cost 6-10 s of
    CPU each in imports; issue 57). The worker is named, not passed: the arguments are unpickled in
    the rank, and naming keeps them plain data. ``process_group=False``: the worker starts its own."""
    with tempfile.TemporaryDirectory(prefix="hapo-gloo-te-") as d, _forked_from(_te_fork_server()):
        store = os.path.join(d, "store") if process_group else None
        mp.start_processes(_te_entry, args=(target, nprocs, store, args), nprocs=nprocs, join=True,
                           start_method="forkserver")


def replace_model_parallel(tp: int = 1, pp: int = 1, seed: int = 7) -> None:
    """Tear down Megatron's parallel state (and its RNG tracker) and bring it up again under
    another layout, in the same processes."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.destroy_model_parallel()
    tensor_parallel.get_cuda_rng_tracker().reset()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
