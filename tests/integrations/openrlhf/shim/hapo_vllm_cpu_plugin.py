"""TEST-ONLY vLLM general plugin: OpenRLHF's vLLM worker extension on CPU.

vLLM runs OpenRLHF's worker extension (``WorkerWrap``) in its own worker process
(spawned: a Ray actor cannot fork), which no Ray setup hook reaches. vLLM loads its
``vllm.general_plugins`` entry points in every process it starts, so this module is
registered as one by ``hapo_vllm_cpu_shim-0.1.dist-info`` beside it: it is found only
where this directory is on the path (the e2e driver's Ray workers and their children).

In each process it patches two things of OpenRLHF 0.11.2 (listed in docs/openrlhf.md):

1. ``distributed_util.stateless_init_process_group`` (vLLM's NCCL communicator) becomes
   the shim's gloo group (``GlooBroadcaster``), the same one the policy actor uses.
2. ``WorkerWrap.update_weight`` runs with ``torch.empty(device="cuda")`` allocating on the
   CPU and ``torch.cuda.current_stream()`` returning ``None``: the two CUDA calls in it.

With ``HAPO_OPENRLHF_DUMP_DIR`` set, the last ``update_weight`` of each sync (OpenRLHF
passes ``empty_cache=True`` with it) also saves the weights vLLM's model now holds (its
own layout: fused ``qkv_proj`` / ``gate_up_proj``) as ``vllm_engine{seed}_sync{n}.pt``,
like the CPU engine's record, so the e2e test can compare them with the trained model.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


@contextlib.contextmanager
def _cuda_calls_on_cpu():
    import torch

    empty, stream = torch.empty, torch.cuda.current_stream

    def cpu_empty(*a, device=None, **k):
        return empty(*a, device="cpu" if device == "cuda" else device, **k)

    torch.empty, torch.cuda.current_stream = cpu_empty, (lambda *a, **k: None)
    try:
        yield
    finally:
        torch.empty, torch.cuda.current_stream = empty, stream


def install() -> None:
    try:
        import openrlhf.utils.distributed_util as du
        from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap
    except ImportError:  # a vLLM process without OpenRLHF: nothing to patch
        return
    if getattr(WorkerWrap.update_weight, "_hapo_cpu", False):
        return
    from hapo_cpu_shim import GlooBroadcaster

    du.stateless_init_process_group = GlooBroadcaster
    orig = WorkerWrap.update_weight

    def update_weight(self, name, dtype, shape, empty_cache=False):
        with _cuda_calls_on_cpu():
            orig(self, name, dtype, shape, empty_cache)
        _record(self, name, empty_cache)

    update_weight._hapo_cpu = True
    WorkerWrap.update_weight = update_weight


def _record(worker, name: str, last: bool) -> None:
    import torch

    dump = os.environ.get("HAPO_OPENRLHF_DUMP_DIR")
    if not dump:
        return
    worker._hapo_synced = getattr(worker, "_hapo_synced", set()) | {name}
    if not last:
        return
    worker._hapo_syncs = getattr(worker, "_hapo_syncs", 0) + 1
    state = {k: v.detach().clone() for k, v in worker.model_runner.model.state_dict().items()}
    path = Path(dump) / f"vllm_engine{worker.model_config.seed}_sync{worker._hapo_syncs}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"updated": sorted(worker._hapo_synced), "weights": state}, path)
    worker._hapo_synced = set()
