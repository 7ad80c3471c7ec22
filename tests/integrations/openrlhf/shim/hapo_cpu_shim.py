"""TEST-ONLY: the smallest CPU shim that lets OpenRLHF 0.11.2 run without CUDA.

Every line here is listed and explained in docs/openrlhf.md ("CPU shim"). It is
installed in the test driver and, through Ray's ``worker_process_setup_hook``
(``install_worker``: each patch when its module is first imported), in every Ray worker. Nothing in ``hapo_openrlhf`` depends on it.

1. ``torch.cuda``: ``current_device`` returns ``"cpu"`` (OpenRLHF moves tensors with
   ``.to(torch.cuda.current_device())``); ``set_device``, ``synchronize``,
   ``empty_cache``, ``current_stream`` do nothing.
2. DeepSpeed strategy: its ``init_device_mesh("cuda", ...)`` builds a CPU mesh.
3. Replay buffer: its unused ``target_device`` (``cuda:N``) becomes ``cpu``.
4. Weight sync: OpenRLHF's NCCL ``stateless_init_process_group`` becomes a
   standalone gloo group with the same ``broadcast(tensor, src, stream)`` method.
5. Rollouts: ``create_vllm_engines`` creates :class:`CpuRolloutActor`, a subclass of
   OpenRLHF's ``RolloutRayActor`` whose vLLM engine is replaced by Hugging Face
   ``generate`` on CPU, with vLLM's ``pause_generation`` / ``resume_generation`` (the
   async trainer's weight sync under partial rollouts) and its count of unfinished
   requests. Upstream's ``generate_responses`` (and so its
   ``SingleTurnAgentExecutor`` and reward-function call) run unchanged. Started with
   vLLM's ``enable_return_routed_experts`` (rollout routing replay: hapo layers its
   ``RoutedExpertsRollout`` over this engine as over vLLM's), it returns each response's
   routed experts as vLLM 0.29 does -- ``[prompt + response - 1, layers, k]``, each token's
   top-k of the model's own router, from one forward of the whole sequence.
   ``HAPO_SHIM_ROUTE_BIAS`` (comma-separated per-expert biases) makes the engine's routers
   pick their top-k by logits + bias -- the routing weights stay the router's own softmax
   at the picked experts -- in generation, log-probs and recorded routes alike: an engine
   that routes apart from the trainer, for the e2e test of routing replay.
6. Speed only: py-cpuinfo's ``get_cpu_info`` (DeepSpeed's CPU Adam and op builder call it,
   each call a fresh interpreter probing the CPU, ~0.4 s of CPU: a dozen per launch) answered
   from a file per boot of this machine after the first call.
7. Preemption mid-run: with ``HAPO_SHIM_STOP_AT_STEP=N`` the stop flag
   (``rundir.preemption.request_flag``) appears while global step N trains -- where the Slurm
   job's SIGUSR1 handler writes it (``cluster/job.py``) -- written just before hapo's controller
   decides that step's checkpoint: one launch trains, is preempted and checkpoints, and the
   e2e tests resume it in a second (issue 57: it was a separate launch with the flag written
   before it started).
Plus, outside this file: ``stubs/`` (import-only ``vllm`` and ``flash_attn``, put on
the path when the real packages are absent), ``ray.init(num_gpus=N)`` so Ray's
``num_gpus=1`` actors can be scheduled, and, for real vLLM engines (item 5 not
installed), ``hapo_vllm_cpu_plugin`` inside vLLM's own processes.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
STUBS = HERE / "stubs"


def stub_path() -> list[str]:
    """Directories to put on the path: the import stubs of the packages that are missing
    (``stubs/vllm``, ``stubs/flash_attn``; a real vLLM is never shadowed)."""
    import importlib.util

    return [str(STUBS / m) for m in ("vllm", "flash_attn") if importlib.util.find_spec(m) is None]


def stubs_first() -> None:
    """The stubs of the missing packages first on ``sys.path``: on import, before anything imports
    openrlhf (it imports vllm / flash_attn); again in a worker forked from ``ray_zygote``'s server,
    whose path is rebuilt as its own interpreter's would be."""
    for p in reversed(stub_path()):
        if p not in sys.path:
            sys.path.insert(0, p)


stubs_first()


def _cuda_shim() -> None:
    import torch

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.current_stream = lambda *a, **k: None


class GlooBroadcaster:
    """A standalone gloo group (not the default one DeepSpeed owns) with OpenRLHF's broadcast API."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, *_):
        import torch.distributed as dist

        store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0),
                              timeout=timedelta(seconds=300))
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("hapo_weight_sync", store), rank, world_size,
                                        timedelta(seconds=300))

    def broadcast(self, tensor, src: int = 0, stream=None) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()


def _patch_mesh(ds) -> None:
    if not getattr(ds.init_device_mesh, "_hapo_cpu", False):
        orig_mesh = ds.init_device_mesh

        def cpu_mesh(_device_type, *a, **k):
            return orig_mesh("cpu", *a, **k)

        cpu_mesh._hapo_cpu = True
        ds.init_device_mesh = cpu_mesh


def _patch_replay_buffer(rb) -> None:
    import torch

    if not getattr(rb.NaiveReplayBuffer.__init__, "_hapo_cpu", False):
        orig_init = rb.NaiveReplayBuffer.__init__

        def rb_init(self, *a, **k):
            torch.cuda.current_device = lambda: 0
            try:
                orig_init(self, *a, **k)
            finally:
                torch.cuda.current_device = lambda: "cpu"
            self.target_device = torch.device("cpu")

        rb_init._hapo_cpu = True
        rb.NaiveReplayBuffer.__init__ = rb_init


def _patch_ppo_actor(pa) -> None:
    pa.stateless_init_process_group = GlooBroadcaster


def _patch_megatron(_core) -> None:
    from tests.megatron.cuda_shim import install as install_megatron_shim

    install_megatron_shim()


def _patch_cpuinfo(cpuinfo) -> None:
    import json
    import tempfile

    if getattr(cpuinfo.get_cpu_info, "_hapo_cpu", False):
        return
    probe = cpuinfo.get_cpu_info
    boot = Path("/proc/sys/kernel/random/boot_id")
    boot_id = boot.read_text().strip() if boot.exists() else "noboot"
    cache = Path(tempfile.gettempdir()) / f"hapo-cpuinfo-{os.getuid()}-{boot_id}.json"

    def get_cpu_info():
        try:
            info = json.loads(cache.read_text())
            if isinstance(info, dict) and isinstance(info.get("arch"), str) and isinstance(info.get("flags"), list):
                return info  # what DeepSpeed reads; anything else is not a probe's answer: probe again
        except (OSError, ValueError):  # none yet, or torn
            pass
        info = probe()  # and write it whole, by rename
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, cache)
        return info

    get_cpu_info._hapo_cpu = True
    cpuinfo.get_cpu_info = get_cpu_info


def _patch_stop_at_step(trainer) -> None:
    """Item 7: hapo's controller (both trainers' ``save_logs_and_checkpoints``, from their
    mixin) finds the stop flag at global step ``HAPO_SHIM_STOP_AT_STEP``. In the workers only:
    ``ray.remote`` copies the controller's methods onto the actor class it makes (Ray's tracing
    wrappers), which the driver pickles by value; a method it finds unpatched at its module path
    goes by reference, and the controller's worker resolves it to this patched one. Patched in the
    driver too, the copy would travel by value, unpatched."""
    mixin = trainer.HapoControllerMixin
    if getattr(mixin.save_logs_and_checkpoints, "_hapo_cpu", False):
        return
    at, save = int(os.environ["HAPO_SHIM_STOP_AT_STEP"]), mixin.save_logs_and_checkpoints

    def save_with_stop(self, global_step, logs_dict=None, client_states=None):
        if global_step == at:
            from hapo_openrlhf.rundir.preemption import request_flag

            request_flag(self.cfg.output_dir).touch()
        return save(self, global_step, logs_dict, client_states)

    save_with_stop._hapo_cpu = True
    mixin.save_logs_and_checkpoints = save_with_stop


def _patches() -> dict:
    """Module -> what it needs, items 1-4 and 6 above (and megatron-core's CPU shim with
    HAPO_SHIM_MEGATRON=1)."""
    patches = {"torch": lambda _torch: _cuda_shim(), "cpuinfo": _patch_cpuinfo,
               "openrlhf.utils.deepspeed.deepspeed": _patch_mesh,
               "openrlhf.trainer.ppo_utils.replay_buffer": _patch_replay_buffer,
               "openrlhf.trainer.ray.ppo_actor": _patch_ppo_actor}
    if os.environ.get("HAPO_SHIM_MEGATRON") == "1":
        patches["megatron.core"] = _patch_megatron
    return patches


def install() -> None:
    """The driver's: items 1-4 and 6 above, every module they patch imported now."""
    import importlib

    for name, patch in _patches().items():
        patch(importlib.import_module(name))


class _AfterImport:
    """A ``sys.meta_path`` finder that runs ``patch(module)`` right after each named module's own
    code, the first time anything imports it (the loader's ``exec_module``, wrapped)."""

    def __init__(self, patches: dict):
        self.patches = dict(patches)

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        else:
            return None
        patch, exec_module = self.patches.pop(name), spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


_worker_installed = False


def install_worker() -> None:
    """Ray ``worker_process_setup_hook``: items 1-4, 6 and 7 above, each applied when its module is first
    imported -- now, if it already is. A worker that never imports them (OpenRLHF's queue, lock
    and state actors of the asynchronous trainer) never pays for torch, DeepSpeed and OpenRLHF:
    importing them in every worker cost ~6 s of CPU each, 11 such actors in the async test's three
    launches (issue 57). Once per process: a worker forked from ``ray_zygote``'s server, which
    installed it before its imports, keeps that installation."""
    global _worker_installed
    if _worker_installed:
        return
    _worker_installed = True
    later, patches = {}, _patches()
    if os.environ.get("HAPO_SHIM_STOP_AT_STEP"):
        patches["hapo_openrlhf.integrations.openrlhf.controller.trainer"] = _patch_stop_at_step
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            later[name] = patch
    if later:
        sys.meta_path.insert(0, _AfterImport(later))


def install_driver(engine: str = "cpu") -> None:
    """Driver side: :func:`install`, plus item 5 (CPU rollout engines) unless ``engine`` is
    ``"vllm"`` (real vLLM engines; their worker processes get ``hapo_vllm_cpu_plugin``)."""
    install()
    if engine == "cpu":
        import openrlhf.cli.train_ppo_ray as cli
        from hapo_cpu_rollout import create_cpu_engines

        cli.create_vllm_engines = create_cpu_engines


def record_sync(owner, name: str, last: bool, model, stem: str) -> None:
    """With ``HAPO_OPENRLHF_DUMP_DIR`` set: note ``name`` as updated and, on the last tensor of
    a sync (OpenRLHF passes ``empty_cache=True`` with it), save what ``model`` now holds and the
    names updated since the previous record as ``DUMP/{stem}_sync{n}.pt`` (the e2e tests
    compare them with the trained model). Used by both rollout engines."""
    import torch

    dump = os.environ.get("HAPO_OPENRLHF_DUMP_DIR")
    if not dump:
        return
    synced = owner.__dict__.setdefault("_hapo_synced", set())
    synced.add(name)
    if not last:
        return
    owner._hapo_syncs = getattr(owner, "_hapo_syncs", 0) + 1
    Path(dump).mkdir(parents=True, exist_ok=True)
    torch.save({"updated": sorted(synced), "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}},
               Path(dump) / f"{stem}_sync{owner._hapo_syncs}.pt")
    synced.clear()


def __getattr__(name: str):
    """Item 5 lives in hapo_cpu_rollout (imported where it is used: the driver, the engine's worker)."""
    if name in ("CpuRolloutActorImpl", "create_cpu_engines"):
        import hapo_cpu_rollout

        return getattr(hapo_cpu_rollout, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
