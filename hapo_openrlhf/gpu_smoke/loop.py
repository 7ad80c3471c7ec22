"""OpenRLHF's loop on the GPU: a vLLM engine in sleep mode with a stop and resume, on DeepSpeed
and on the Megatron actor; vLLM's routed experts against Hugging Face's router."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


from .common import check_in_child, run


def smoke_run_config(model_dir: str | Path, backend: str = "openrlhf", gpus: int = 1,
                     flash_attn: bool = True) -> dict[str, Any]:
    """The run config of the smoke's OpenRLHF loop: a tiny warmed-up Qwen2 (head dim 64),
    2 global steps of 4 prompts x 4 samples, HAPO, a CUDA vLLM engine colocated with the
    actor in sleep mode (weights synced over CUDA IPC), or, for ``megatron``, the Megatron
    actor at TP=1 (packed THD micro-batches by a 128-token budget, FlashCoreAttention) with
    the engine on a second GPU."""
    megatron = backend == "megatron"
    return {
        "run_name": f"gpu_smoke_{backend}", "seed": 7, "backend": backend, "model": {"path": str(model_dir)},
        "data": {"train": "synthetic", "template": "tiny",
                 "synthetic": {"n_terms": 3, "digits": 1, "ops": "+-", "train_size": 16, "eval_size": 8}},
        "warmup": {"steps": 0},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "temperature": 1.0, "top_p": 1.0,
                    "max_new_tokens": 24},
        "algorithm": {"estimator": "hapo", "estimator_params": {"alpha": 0.2, "phi": 2.0}, "loss": "ppo",
                      "loss_params": {"eps_low": 0.2, "eps_high": 0.28}, "overlong": {"enable": True, "cache_len": 4}},
        "optim": {"lr": 1.0e-4},
        "trainer": {"steps": 2, "save_every": 1, "keep_last": 4},
        "openrlhf": {
            "actor_num_nodes": 1, "actor_gpus_per_node": 1, "vllm_num_engines": 1,
            "colocate_all": not megatron, "vllm_enable_sleep": not megatron,
            "vllm_gpu_memory_utilization": 0.5 if megatron else 0.3, "vllm_enforce_eager": True,
            "zero_stage": 2, "param_dtype": "bf16",
            "attn_implementation": "flash_attention_2" if flash_attn and not megatron else "sdpa",
            "packing_samples": flash_attn or megatron, "gradient_checkpointing": False, "max_len": 96,
            **({"dynamic_batch": True, "max_tokens_per_gpu": 128} if megatron else {}),
            "train_batch_size": 16, "micro_train_batch_size": 4, "micro_rollout_batch_size": 4, "num_episodes": 4,
            "lr_scheduler": "constant"},
        **({"megatron": {"tensor_parallel": 1, "pipeline_parallel": 1, "params_dtype": "bf16"}} if megatron else {}),
    }


def smoke_warm_model(work: Path) -> Path:
    out = work / "warm"
    if not (out / "final_model" / "config.json").exists():
        rc = run([sys.executable, "-m", "hapo_openrlhf", "train", "--config", str(repo_config("cpu_tiny.yaml")),
                   "--output-dir", str(out), "--set", "warmup.steps=150", "--set", "trainer.steps=0",
                   "--set", "data.synthetic.eval_size=16", "--set", "model.hidden_size=128",
                   "--set", "model.num_heads=2", "--set", "model.num_kv_heads=2"], work / "warm.log")
        if rc:
            raise RuntimeError(f"the warm-up of the smoke model failed (rc {rc}, {work / 'warm.log'})")
    return out / "final_model"


def repo_config(name: str) -> Path:
    p = Path(__file__).resolve().parents[2] / "configs" / name
    if not p.exists():
        raise FileNotFoundError(f"{p}: the GPU smoke runs from a checkout of the repository")
    return p


def smoke_openrlhf_loop(work: Path, backend: str = "openrlhf") -> dict:
    """OpenRLHF's loop for 2 steps, then a stop (exit 85) after step 3 and a resume to step 4."""
    import torch
    import yaml

    from ..rundir.preemption import EXIT_PREEMPTED, request_flag

    if backend == "megatron" and torch.cuda.device_count() < 2:
        return {"ok": True, "skipped": "the Megatron actor needs a second GPU for the vLLM engine (it has no sleep "
                                       "mode, so backend megatron refuses colocation)"}
    model = smoke_warm_model(work)
    try:
        import flash_attn  # noqa: F401
        fa = True
    except ImportError:
        fa = False
    cfg_path = work / f"smoke_{backend}.yaml"
    cfg_path.write_text(yaml.safe_dump(smoke_run_config(model, backend, flash_attn=fa)))
    out, log = work / f"run_{backend}", work / f"run_{backend}.log"
    train = [sys.executable, "-m", "hapo_openrlhf.integrations.openrlhf.launch.train", "--config", str(cfg_path),
             "--output-dir", str(out)]
    t0 = time.perf_counter()
    rc1 = run(train, log)
    t_two = time.perf_counter() - t0
    request_flag(out).touch()
    rc2 = run([*train, "--set", "trainer.steps=4"], log)
    request_flag(out).unlink(missing_ok=True)
    rc3 = run([*train, "--set", "trainer.steps=4"], log)
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    text = log.read_text(errors="replace")
    return {"returncodes": [rc1, rc2, rc3], "steps": steps, "two_steps_s": round(t_two, 1), "flash_attn": fa,
            "ok": rc1 == 0 and rc2 == EXIT_PREEMPTED and rc3 == 0 and steps == [1, 2, 3, 4]
            and "Loading the checkpoint" in text and (out / "final" / "config.json").exists(),
            "log": str(log)}


def smoke_vllm_routes(work: Path) -> dict:
    """Rollout routing replay's engine side on the installed vLLM (docs/megatron.md, "Rollout
    routing replay"): :func:`vllm_routes_check` in a child process (vLLM holds its GPU memory)."""
    return check_in_child(work, "vllm_routes_check", ("vllm",))


def vllm_routes_check(device: str = "cuda") -> dict:
    """vLLM started with ``enable_return_routed_experts`` (what ``megatron.moe.routing_replay: r3``
    starts its engines with) on a tiny random Qwen3-MoE returns, per request, routes
    [prompt + response - 1, layers, k] (every token a forward took as input); against Hugging Face's
    router top-k of the same tokens in fp32 (the engine runs bf16: a near tie may flip, as the CPU
    proxy in test_moe.py measured), at least 90% of the (token, layer) routings are the same set."""
    import tempfile

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from vllm import LLM, SamplingParams

    from ..data.tokenizer import build_tokenizer

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                         tie_word_embeddings=False)
    hf = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)  # decisive routing
    d = Path(tempfile.mkdtemp(prefix="hapo_vllm_routes_"))
    hf.save_pretrained(d)
    build_tokenizer().save_pretrained(d)
    llm = LLM(model=str(d), dtype="bfloat16", enable_return_routed_experts=True, enforce_eager=True,
              gpu_memory_utilization=0.2, max_model_len=256)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (5, 17, 30)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=1.0, seed=0, ignore_eos=True))
    hf = hf.to(device)
    shapes, same, total = [], 0, 0
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        routes = getattr(c, "routed_experts", None)
        tokens = p + list(c.token_ids)
        shapes.append(None if routes is None else list(routes.shape))
        if routes is None or list(routes.shape) != [len(tokens) - 1, 2, 2]:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([tokens[:-1]], device=device), output_router_logits=True).router_logits
        for i, lg in enumerate(logits):
            want = torch.topk(lg.float(), 2, -1).indices.sort(-1).values.cpu()
            got = torch.as_tensor(routes[:, i]).long().sort(-1).values
            same += int((got == want).all(-1).sum())
            total += len(want)
    agree = same / total if total else 0.0
    ok = all(s is not None for s in shapes) and total == sum(len(p) + 15 for p in prompts) * 2 and agree >= 0.9
    return {"ok": ok, "routes_shapes": shapes, "routings": total, "same_as_hf": agree}
