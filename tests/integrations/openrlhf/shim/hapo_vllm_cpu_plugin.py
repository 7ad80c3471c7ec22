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

3. vLLM's CPU linear layers keep their weights as ordinary, reloadable parameters
   (``dispatch_cpu_unquantized_gemm`` -> ``torch.nn.functional.linear``). On CPUs with
   AVX-512 (oneDNN) or AMX (sgl kernels) vLLM 0.29 packs each linear weight into a
   kernel handle and replaces the parameter with an empty one without ``weight_loader``,
   so no weight can be loaded into the model again (``'Parameter' object has no attribute
   'weight_loader'`` at the first sync). On GPU the parameters stay reloadable; this
   only changes which CPU GEMM runs.

With ``HAPO_OPENRLHF_DUMP_DIR`` set, the last ``update_weight`` of each sync also saves the
weights vLLM's model now holds (its own layout: fused ``qkv_proj`` / ``gate_up_proj``) as
``vllm_engine{seed}_sync{n}.pt``, through the shim's ``record_sync`` (as the CPU engine does);
and every generation that returns log-probs (the mismatch correction asks for them) is
recorded straight from vLLM's ``RequestOutput`` -- the full token ids and the sampled
tokens' log-probs -- in ``vllm_logprobs_{pid}.jsonl``, so the e2e test can check that the
``rollout_log_probs`` reaching hapo's loss are vLLM's own.
"""

from __future__ import annotations

import contextlib


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


def _keep_cpu_linear_weights() -> None:
    try:
        import vllm.model_executor.layers.utils as lu
    except ImportError:
        return
    if getattr(lu.dispatch_cpu_unquantized_gemm, "_hapo_cpu", False):
        return

    def dispatch(layer, remove_weight):
        import torch

        layer.cpu_linear = torch.nn.functional.linear  # reads the live (reloadable) weight

    dispatch._hapo_cpu = True
    lu.dispatch_cpu_unquantized_gemm = dispatch


def install() -> None:
    _keep_cpu_linear_weights()
    try:
        import openrlhf.utils.distributed_util as du
        from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap
    except ImportError:  # a vLLM process without OpenRLHF: nothing to patch
        return
    if getattr(WorkerWrap.update_weight, "_hapo_cpu", False):
        return
    from hapo_cpu_shim import GlooBroadcaster, record_sync

    du.stateless_init_process_group = GlooBroadcaster
    orig = WorkerWrap.update_weight

    def update_weight(self, name, dtype, shape, empty_cache=False):
        with _cuda_calls_on_cpu():
            orig(self, name, dtype, shape, empty_cache)
        record_sync(self, name, empty_cache, self.model_runner.model, f"vllm_engine{self.model_config.seed}")

    update_weight._hapo_cpu = True
    WorkerWrap.update_weight = update_weight
    _record_logprobs()


class _RecordingEngine:
    """``llm_engine`` as OpenRLHF's agent executor calls it, recording each output's
    sampled-token log-probs (vLLM's own values) before OpenRLHF reads them."""

    def __init__(self, engine, path):
        self._engine, self._path = engine, path

    async def generate(self, prompt_token_ids, params, **kwargs):
        import json

        out = await self._engine.generate(prompt_token_ids, params, **kwargs)
        o = out.outputs[0]
        if o.logprobs is not None:
            import os

            lps = [d[t].logprob if t in d else None for t, d in zip(o.token_ids, o.logprobs)]
            os.makedirs(os.path.dirname(self._path), exist_ok=True)
            with open(self._path, "a") as f:
                f.write(json.dumps({"tokens": list(prompt_token_ids) + list(o.token_ids), "logprobs": lps}) + "\n")
        return out

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _record_logprobs() -> None:
    import os

    d = os.environ.get("HAPO_OPENRLHF_DUMP_DIR")
    if not d:
        return
    from openrlhf.utils.agent import SingleTurnAgentExecutor

    orig = SingleTurnAgentExecutor.execute
    path = os.path.join(d, f"vllm_logprobs_{os.getpid()}.jsonl")

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        return await orig(self, prompt, label, sampling_params, max_length, hf_tokenizer,
                          _RecordingEngine(llm_engine, path), images)

    SingleTurnAgentExecutor.execute = execute

