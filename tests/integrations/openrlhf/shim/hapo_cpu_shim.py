"""TEST-ONLY: the smallest CPU shim that lets OpenRLHF 0.11.2 run without CUDA.

Every line here is listed and explained in docs/openrlhf.md ("CPU shim"). It is
installed in the test driver and, through Ray's ``worker_process_setup_hook``, in
every Ray worker. Nothing in ``hapo_openrlhf`` depends on it.

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
Plus, outside this file: ``stubs/`` (import-only ``vllm`` and ``flash_attn``, put on
the path when the real packages are absent), ``ray.init(num_gpus=N)`` so Ray's
``num_gpus=1`` actors can be scheduled, and, for real vLLM engines (item 5 not
installed), ``hapo_vllm_cpu_plugin`` inside vLLM's own processes.
"""

from __future__ import annotations

import asyncio
import os
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
STUBS = HERE / "stubs"


def stub_path() -> list[str]:
    """Directories to put on the path: the import stubs of the packages that are missing
    (``stubs/vllm``, ``stubs/flash_attn``; a real vLLM is never shadowed)."""
    import importlib.util

    return [str(STUBS / m) for m in ("vllm", "flash_attn") if importlib.util.find_spec(m) is None]


for _p in reversed(stub_path()):  # before anything imports openrlhf (it imports vllm / flash_attn)
    if _p not in sys.path:
        sys.path.insert(0, _p)


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


def install() -> None:
    """Ray ``worker_process_setup_hook`` (and driver): items 1-4 above (plus, with
    ``HAPO_SHIM_MEGATRON=1``, megatron-core's CPU shim for the Megatron policy actor)."""
    _cuda_shim()
    if os.environ.get("HAPO_SHIM_MEGATRON") == "1":
        from tests.megatron.cuda_shim import install as install_megatron_shim

        install_megatron_shim()
    import torch
    import openrlhf.trainer.ppo_utils.replay_buffer as rb
    import openrlhf.trainer.ray.ppo_actor as pa
    import openrlhf.utils.deepspeed.deepspeed as ds

    if not getattr(ds.init_device_mesh, "_hapo_cpu", False):
        orig_mesh = ds.init_device_mesh

        def cpu_mesh(_device_type, *a, **k):
            return orig_mesh("cpu", *a, **k)

        cpu_mesh._hapo_cpu = True
        ds.init_device_mesh = cpu_mesh
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
    pa.stateless_init_process_group = GlooBroadcaster


def install_driver(engine: str = "cpu") -> None:
    """Driver side: :func:`install`, plus item 5 (CPU rollout engines) unless ``engine`` is
    ``"vllm"`` (real vLLM engines; their worker processes get ``hapo_vllm_cpu_plugin``)."""
    install()
    if engine == "cpu":
        import openrlhf.cli.train_ppo_ray as cli

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


# ------------------------------------------------------------ rollout engine
def _rollout_base():
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    return RolloutRayActor.__ray_actor_class__


class CpuRolloutActorImpl(_rollout_base()):
    """OpenRLHF's rollout actor with Hugging Face ``generate`` in place of vLLM."""

    async def __init__(self, model: str, seed: int = 0, remote_rm_url=None, max_model_len: int = 2048,
                       logprobs_mode=None, enable_return_routed_experts: bool = False, **_kw):
        import torch
        from openrlhf.utils.agent import SingleTurnAgentExecutor
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.executor = SingleTurnAgentExecutor(remote_rm_url)
        self.model = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.params = dict(self.model.named_parameters())
        self.seed = seed
        self.logprobs_mode = logprobs_mode or "raw_logprobs"  # vLLM's default
        self.return_routes = enable_return_routed_experts
        bias = os.environ.get("HAPO_SHIM_ROUTE_BIAS")
        self.route_bias = torch.tensor([float(b) for b in bias.split(",")]) if bias else None
        if self.route_bias is not None:
            _bias_routers(self.model, self.route_bias)
        self.calls = 0
        self._mm_pad_token_ids = None
        self._group = None
        self._inflight = 0
        self._running = asyncio.Event()  # cleared by pause_generation
        self._running.set()

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        self._inflight += 1
        try:
            await self._running.wait()  # paused (a weight sync under partial rollouts): wait for resume
            return self._generate(prompt_token_ids, sampling_params)
        finally:
            self._inflight -= 1

    def _generate(self, prompt_token_ids, sampling_params):
        import torch

        self.calls += 1
        torch.manual_seed(self.seed * 1_000_003 + self.calls)
        ids = torch.tensor([prompt_token_ids])
        eos = self.tokenizer.eos_token_id
        with torch.no_grad():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=True,
                temperature=sampling_params.temperature, top_p=sampling_params.top_p, top_k=0,
                max_new_tokens=sampling_params.max_tokens, eos_token_id=eos, pad_token_id=eos,
            )
        new = out[0, ids.shape[1]:].tolist()
        if eos in new:
            new = new[: new.index(eos) + 1]
        finish = "stop" if (new and new[-1] == eos) else "length"
        text = self.tokenizer.decode(new, skip_special_tokens=sampling_params.skip_special_tokens)
        logprobs = None
        if sampling_params.logprobs is not None and new:
            from hapo_openrlhf.algos.nucleus import nucleus_logprobs

            full = torch.tensor([prompt_token_ids + new])
            with torch.no_grad():
                z = self.model(full).logits[0, len(prompt_token_ids) - 1: -1].float()
            if self.logprobs_mode == "raw_logprobs":  # vLLM's: before temperature and top-p
                all_lp = torch.log_softmax(z, -1)
            elif self.logprobs_mode == "processed_logprobs":  # after temperature and top-p (renormalised)
                all_lp = nucleus_logprobs(z / sampling_params.temperature, sampling_params.top_p)
            else:
                raise ValueError(f"the CPU rollout engine serves raw_logprobs and processed_logprobs, "
                                 f"not {self.logprobs_mode}")
            lp = all_lp.gather(-1, torch.tensor(new)[:, None])[:, 0].tolist()
            logprobs = [{t: SimpleNamespace(logprob=v)} for t, v in zip(new, lp)]
        routes = self._routes(prompt_token_ids + new) if self.return_routes else None
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=new, text=text, finish_reason=finish,
                                                        logprobs=logprobs, routed_experts=routes)])

    def _routes(self, tokens):
        """vLLM 0.29's ``CompletionOutput.routed_experts``: [len - 1, layers, k] int, the router's
        top-k for every token a forward took as input (all but the last)."""
        import torch

        k = int(self.model.config.num_experts_per_tok)
        with torch.no_grad():
            logits = self.model(torch.tensor([tokens[:-1]]), output_router_logits=True).router_logits
        logits = [lg.float().view(len(tokens) - 1, -1) for lg in logits]
        if self.route_bias is not None:  # what the biased routers picked
            logits = [lg + self.route_bias for lg in logits]
        return torch.stack([torch.topk(lg, k, dim=-1).indices for lg in logits], 1).to(torch.int16).numpy()

    def get_num_unfinished_requests(self) -> int:
        return self._inflight

    async def pause_generation(self):
        """vLLM's ``pause_generation(mode="keep")``, which the async trainer calls around a
        weight sync under partial rollouts: requests already generating finish (this engine
        generates a request in one blocking call, so none is mid-way while this runs), new
        ones wait until :meth:`resume_generation`."""
        self._running.clear()

    async def resume_generation(self):
        self._running.set()

    async def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name, backend,
                                 use_ray):
        self._group = GlooBroadcaster(master_address, master_port, rank_offset, world_size)

    async def update_weight(self, name, dtype, shape, empty_cache=False):
        import torch

        w = torch.empty(shape, dtype=dtype)
        self._group.broadcast(w, src=0)
        with torch.no_grad():
            _param_view(self.params, name).copy_(w)
        record_sync(self, name, empty_cache, self.model, f"engine{self.seed}")

    async def reset_prefix_cache(self):
        return None

    async def sleep(self, level=1):
        return None

    async def wake_up(self, tags=None):
        return None


def _bias_routers(model, bias) -> None:
    """Every router of a transformers Qwen3-MoE picks its top-k by logits + ``bias`` (per expert);
    the routing weights stay its softmax at the picked experts, renormalised as ``norm_topk_prob``
    says (``Qwen3MoeTopKRouter.forward`` with the selection moved). Weight syncs keep it: only the
    forward is replaced."""
    import types

    import torch

    def forward(self, hidden_states):
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(h, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        idx = torch.topk(logits.float() + bias, self.top_k, dim=-1).indices
        top = probs.gather(1, idx)
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.forward = types.MethodType(forward, gate)


def _param_view(params, name: str):
    """The engine model's tensor for a synced name: the parameter itself, or -- for a mixture of
    experts, which the sync sends per expert under the checkpoint's names while transformers keeps
    them fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) -- expert j's slice."""
    import re

    if name in params:
        return params[name]
    m = re.fullmatch(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight", name)
    if m is None:
        raise KeyError(f"the CPU engine's model has no parameter {name!r}")
    prefix, j, which = m.group(1), int(m.group(2)), m.group(3)
    if which == "down":
        return params[prefix + "down_proj"][j]
    gate_up = params[prefix + "gate_up_proj"][j]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if which == "gate" else gate_up[half:]


def create_cpu_engines(num_engines, tensor_parallel_size, pretrain, seed, full_determinism, enable_prefix_caching,
                       enforce_eager, max_model_len, shared_pg=None, gpu_memory_utilization=None,
                       vllm_enable_sleep=False, logprobs_mode=None, agent_func_path=None, remote_rm_url=None,
                       max_images_per_prompt=0):
    """Same signature as ``openrlhf.trainer.ray.vllm_engine.create_vllm_engines``."""
    import ray

    if tensor_parallel_size != 1 or agent_func_path:
        raise ValueError("the CPU rollout engine supports tensor_parallel_size 1 and single-turn rewards only")
    # what hapo layered over OpenRLHF's rollout actor (routes.RoutedExpertsRollout), over this engine too
    import openrlhf.trainer.ray.vllm_engine as ve

    mixins = getattr(ve.RolloutRayActor.__ray_actor_class__, "hapo_engine_mixins", ())
    actor = ray.remote(type("CpuRolloutActor", (*mixins, CpuRolloutActorImpl), {}) if mixins else CpuRolloutActorImpl)
    return [actor.options(num_cpus=0, num_gpus=0).remote(model=pretrain, seed=seed + i, remote_rm_url=remote_rm_url,
                                                         max_model_len=max_model_len, logprobs_mode=logprobs_mode)
            for i in range(num_engines)]
