"""TEST-ONLY: item 5 of hapo_cpu_shim -- the CPU rollout engine (``CpuRolloutActorImpl``, a
subclass of OpenRLHF's ``RolloutRayActor`` with Hugging Face ``generate`` in place of vLLM) and
``create_cpu_engines``. A module of its own because defining the class imports OpenRLHF's
rollout actor: only the driver and the engine's own worker import it, not every Ray worker
(issue 57). See hapo_cpu_shim's docstring, item 5."""

from __future__ import annotations

import asyncio
import json
import os
import zlib
from types import SimpleNamespace

from hapo_cpu_shim import GlooBroadcaster, record_sync


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
        self._occurrences: dict[tuple, int] = {}  # prompt tokens -> requests for them so far
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

        # the sample is a function of the engine's seed, the prompt and how many times it was asked for
        # (samples_per_prompt copies): not of the order concurrent requests arrive in, which varies
        # with the machine's load -- so two launches of one config draw the same rollouts
        key = tuple(prompt_token_ids)
        n = self._occurrences.get(key, 0)
        self._occurrences[key] = n + 1
        digest = zlib.crc32(json.dumps(prompt_token_ids).encode())
        torch.manual_seed((self.seed * 1_000_003 + digest * 7_919 + n) % (2 ** 63))
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
