"""``hapo doctor --gpu-smoke``: the one-GPU acceptance run (docs/status.md records each run).

    hapo doctor --gpu-smoke [--json] [--output-dir DIR]

What the CPU tests cannot see: the bf16 fused head against the naive one, the bf16
weight-gradient GEMM (and its in-place accumulation), flash-attn varlen against padded
attention, the algorithms on CUDA, megatron-core's attention against the local one, and
OpenRLHF's loop with a vLLM engine (sleep mode, stop and resume), with DeepSpeed and with
the Megatron actor. Each step reports its own figures and ``ok``; the preflight checks
are in :mod:`hapo_openrlhf.doctor`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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


def _run(cmd: list[str], log: Path, timeout: int = 900, env: dict | None = None) -> int:
    import subprocess

    with open(log, "ab") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, **(env or {})}).returncode


def _smoke_warm_model(work: Path) -> Path:
    out = work / "warm"
    if not (out / "final_model" / "config.json").exists():
        rc = _run([sys.executable, "-m", "hapo_openrlhf", "train", "--config", str(_repo_config("cpu_tiny.yaml")),
                   "--output-dir", str(out), "--set", "warmup.steps=150", "--set", "trainer.steps=0",
                   "--set", "data.synthetic.eval_size=16", "--set", "model.hidden_size=128",
                   "--set", "model.num_heads=2", "--set", "model.num_kv_heads=2"], work / "warm.log")
        if rc:
            raise RuntimeError(f"the warm-up of the smoke model failed (rc {rc}, {work / 'warm.log'})")
    return out / "final_model"


def _repo_config(name: str) -> Path:
    p = Path(__file__).resolve().parent.parent / "configs" / name
    if not p.exists():
        raise FileNotFoundError(f"{p}: the GPU smoke runs from a checkout of the repository")
    return p


def _smoke_openrlhf_loop(work: Path, backend: str = "openrlhf") -> dict:
    """OpenRLHF's loop for 2 steps, then a stop (exit 85) after step 3 and a resume to step 4."""
    import torch
    import yaml

    from .rundir.preemption import EXIT_PREEMPTED, request_flag

    if backend == "megatron" and torch.cuda.device_count() < 2:
        return {"ok": True, "skipped": "the Megatron actor needs a second GPU for the vLLM engine (it has no sleep "
                                       "mode, so backend megatron refuses colocation)"}
    model = _smoke_warm_model(work)
    try:
        import flash_attn  # noqa: F401
        fa = True
    except ImportError:
        fa = False
    cfg_path = work / f"smoke_{backend}.yaml"
    cfg_path.write_text(yaml.safe_dump(smoke_run_config(model, backend, flash_attn=fa)))
    out, log = work / f"run_{backend}", work / f"run_{backend}.log"
    train = [sys.executable, "-m", "hapo_openrlhf.integrations.openrlhf.train", "--config", str(cfg_path),
             "--output-dir", str(out)]
    t0 = time.perf_counter()
    rc1 = _run(train, log)
    t_two = time.perf_counter() - t0
    request_flag(out).touch()
    rc2 = _run([*train, "--set", "trainer.steps=4"], log)
    request_flag(out).unlink(missing_ok=True)
    rc3 = _run([*train, "--set", "trainer.steps=4"], log)
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    text = log.read_text(errors="replace")
    return {"returncodes": [rc1, rc2, rc3], "steps": steps, "two_steps_s": round(t_two, 1), "flash_attn": fa,
            "ok": rc1 == 0 and rc2 == EXIT_PREEMPTED and rc3 == 0 and steps == [1, 2, 3, 4]
            and "Loading the checkpoint" in text and (out / "final" / "config.json").exists(),
            "log": str(log)}


def gpu_smoke(output_dir: str | Path | None = None) -> dict[str, Any]:
    """The one-GPU acceptance run (docs/status.md). Without CUDA it reports that and stops."""
    import tempfile

    import torch

    if not torch.cuda.is_available():
        return {"ok": False, "cuda": False, "error": "no CUDA GPU visible: the GPU smoke needs one "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None})", "results": []}
    work = Path(output_dir) if output_dir else Path(tempfile.mkdtemp(prefix="hapo_gpu_smoke_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for name, fn in (("fused_head_bf16_vs_naive", _smoke_fused_head), ("weight_grad_bf16_gemm", _smoke_weight_gemm),
                     ("flash_attn_varlen_vs_padded", _smoke_flash_varlen), ("algos_on_cuda", _smoke_algos),
                     ("megatron_attention_vs_local", lambda: _smoke_megatron_attention(work)),
                     ("megatron_fused_vocab_head_vs_logits", _smoke_megatron_head),
                     ("megatron_distributed_optimizer_step", lambda: _smoke_distributed_optimizer(work)),
                     ("megatron_optimizer_resume_bitwise", lambda: _smoke_optimizer_resume(work)),
                     ("megatron_te_spec_vs_hf", lambda: _smoke_te_spec(work)),
                     ("megatron_moe_vs_hf", lambda: _smoke_moe(work)),
                     ("vllm_routed_experts_vs_hf", lambda: _smoke_vllm_routes(work)),
                     ("openrlhf_loop_vllm_sleep_stop_resume", lambda: _smoke_openrlhf_loop(work)),
                     ("megatron_tp1_loop", lambda: _smoke_openrlhf_loop(work, "megatron"))):
        t0 = time.perf_counter()
        try:
            r = fn()
            r.setdefault("ok", True)
        except Exception as e:  # noqa: BLE001 - each step reports its own failure
            r = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        r.update(name=name, wall_s=round(time.perf_counter() - t0, 2))
        results.append(r)
    summary = {"ok": all(r["ok"] for r in results), "cuda": True, "device": torch.cuda.get_device_name(0),
               "torch": torch.__version__, "results": results, "work_dir": str(work)}
    (work / "gpu_smoke.json").write_text(json.dumps(summary, indent=1))
    return summary


def _peak(fn):
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 2**20, time.perf_counter() - t0


def _smoke_fused_head(tokens: int = 16384, hidden: int = 1536, vocab: int = 151936) -> dict:
    """Fused bf16 head vs the naive [T, V] fp32 logits, forward + backward: values, memory, time."""
    import torch

    from .algos import fused_logprobs_entropy, logprobs_and_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(tokens, hidden, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_(True)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_(True)
    lab = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)

    def fused():
        lp, ent = fused_logprobs_entropy(h, w, lab, chunk_size=1024)
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone()

    def naive():
        lp, ent = logprobs_and_entropy((h @ w.t()).float(), lab, chunk_size=tokens)
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone()

    (a, mem_f, t_f) = _peak(fused)
    h.grad = w.grad = None
    (b, mem_n, t_n) = _peak(naive)
    err = {k: float((x.float() - y.float()).abs().max()) for k, x, y in zip(("logp", "entropy"), a[:2], b[:2])}
    rel_w = float((a[3].float() - b[3].float()).norm() / b[3].float().norm())
    return {"tokens": tokens, "peak_mib_fused": round(mem_f), "peak_mib_naive": round(mem_n),
            "mem_ratio": round(mem_f / mem_n, 3), "time_ratio": round(t_f / t_n, 3), "max_abs_err": err,
            "weight_grad_rel_err": rel_w, "ok": err["logp"] < 5e-2 and err["entropy"] < 5e-2 and rel_w < 2e-2}


def _smoke_weight_gemm() -> dict:
    """The bf16 weight-gradient GEMM (fp32 output) against fp64, its speed against fp32, and
    its in-place accumulation (addmm with out_dtype and out=): two chunks added into one
    [V,H] fp32 buffer equal twice the product and allocate no [V,H] temporary."""
    import torch

    from .algos.fused import weight_grad_gemm

    g = torch.Generator(device="cuda").manual_seed(1)
    gz = torch.randn(4096, 8192, device="cuda", generator=g) * 1e-3
    hh = torch.randn(4096, 2048, device="cuda", generator=g)
    ref = gz.double().t() @ hh.double()
    got = weight_grad_gemm(gz, hh, torch.bfloat16)
    rel = float((got.double() - ref).norm() / ref.norm())
    # accumulation at a head-like shape: C=1024 tokens, V=32768, H=4096 ([V,H] fp32 = 512 MiB,
    # the chunk's bf16 casts 72 MiB): the extra memory of two accumulating calls stays below [V,H]
    gz2 = torch.randn(1024, 32768, device="cuda", generator=g) * 1e-3
    hh2 = torch.randn(1024, 4096, device="cuda", generator=g)
    ref2 = gz2.double().t() @ hh2.double()
    acc = torch.zeros(32768, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(2):
        weight_grad_gemm(gz2, hh2, torch.bfloat16, out=acc)
    torch.cuda.synchronize()
    extra_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    rel_acc = float((acc.double() - 2 * ref2).norm() / (2 * ref2).norm())
    vh_mib = acc.numel() * 4 / 2**20
    del ref2, acc, gz2, hh2
    t0 = time.perf_counter()
    for _ in range(5):
        weight_grad_gemm(gz, hh, torch.bfloat16)
    torch.cuda.synchronize()
    t_bf16 = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(5):
        weight_grad_gemm(gz, hh, torch.float32)
    torch.cuda.synchronize()
    return {"rel_err": rel, "dtype": str(got.dtype), "speedup_vs_fp32": round((time.perf_counter() - t0) / t_bf16, 2),
            "accumulate_rel_err": rel_acc, "accumulate_extra_mib": round(extra_mib, 1), "vh_fp32_mib": round(vh_mib, 1),
            "ok": got.dtype == torch.float32 and rel < 1e-2 and rel_acc < 1e-2 and extra_mib < 0.5 * vh_mib}


def _smoke_flash_varlen() -> dict:
    import torch
    import torch.nn.functional as F

    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        return {"ok": False, "error": f"flash-attn not importable: {e} (pip install flash-attn==2.8.3 "
                                      f"--no-build-isolation)"}
    g = torch.Generator(device="cuda").manual_seed(2)
    lens = [700, 1500, 300]
    H, Hkv, D = 8, 2, 64
    q = [torch.randn(n, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for n in lens]
    k = [torch.randn(n, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16) for n in lens]
    v = [torch.randn(n, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16) for n in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    packed = flash_attn_varlen_func(torch.cat(q), torch.cat(k), torch.cat(v), cu, cu, max(lens), max(lens), causal=True)
    err = 0.0
    for i, n in enumerate(lens):
        ref = F.scaled_dot_product_attention(q[i].transpose(0, 1)[None], k[i].transpose(0, 1)[None],
                                             v[i].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        err = max(err, float((packed[cu[i]:cu[i + 1]] - ref[0].transpose(0, 1)).abs().max()))
    return {"max_abs_err": err, "ok": err < 2e-2}


def _smoke_megatron_attention(work: Path) -> dict:
    """benchmarks/megatron_attention.py on the GPU (bf16, flash-attn when installed):
    FlashCoreAttention's peak memory and time vs Megatron's local attention at 8k tokens,
    THD vs padded log-probs. Needs megatron-core and a source checkout (the script)."""
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "megatron_attention.py"
    if importlib.util.find_spec("megatron") is None or not script.is_file():
        return {"ok": True, "skipped": f"needs megatron-core and {script}"}
    log = work / "megatron_attention.log"
    rc = _run([sys.executable, str(script), "--seq-len", "8192", "--lengths", "2048,4096,8192", "--hidden", "1024",
               "--heads", "16", "--kv-heads", "2", "--eq-len", "2048"], log, timeout=900)
    lines = log.read_text().strip().splitlines() if log.exists() else []
    try:
        res = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "error": f"exit {rc}; see {log}"}
    err = res.get("thd_vs_padded_max_abs_err")
    mem = res.get("peak_mem_ratio_vs_local")
    return {**{k: res.get(k) for k in ("peak_mem_ratio_vs_local", "time_ratio_vs_local", "peak_mem_ratio_by_len",
                                        "thd_vs_padded_max_abs_err", "thd_vs_masked_max_abs_err")},
            "ok": rc == 0 and mem is not None and mem <= 0.25 and err is not None and err < 5e-2}


def _smoke_megatron_head(tokens: int = 8192, hidden: int = 1536, vocab: int = 151936) -> dict:
    """The Megatron back end's fused vocabulary-parallel head (megatron/head.py, one rank
    holding the whole vocabulary) against the logits path (bf16 output-layer matmul, then
    the vocabulary-parallel reductions), forward + backward with both outputs carrying
    gradient: peak memory, time, values and gradients. benchmarks/megatron_head.py
    measures the same at TP=2 on CPU/gloo."""
    import torch

    from .algos.vocab_parallel import vocab_parallel_logprobs_entropy
    from .megatron.head import fused_vocab_parallel_logprobs_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(tokens, hidden, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_(True)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_(True)
    lab = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    a, b = torch.randn(tokens, device="cuda", generator=g), torch.randn(tokens, device="cuda", generator=g)

    def run(fused: bool):
        h.grad = w.grad = None
        if fused:
            lp, en = fused_vocab_parallel_logprobs_entropy(h, w, lab, vocab_start=0, vocab_size=vocab, chunk_size=1024)
        else:
            lp, en = vocab_parallel_logprobs_entropy(h @ w.t(), lab, vocab_start=0, vocab_size=vocab, chunk_size=1024)
        (lp * a + en * b).sum().backward()
        return lp.detach(), en.detach(), h.grad.float(), w.grad.float()

    (x, mem_f, t_f) = _peak(lambda: run(True))
    (y, mem_n, t_n) = _peak(lambda: run(False))
    rel = {k: float((p - q).norm() / q.norm().clamp(min=1e-30)) for k, p, q in zip(("logp", "entropy", "h", "w"), x, y)}
    return {"tokens": tokens, "peak_mib_fused": round(mem_f), "peak_mib_logits": round(mem_n),
            "mem_ratio": round(mem_f / max(mem_n, 1e-9), 3), "time_ratio": round(t_f / t_n, 3), "rel_err": rel,
            "ok": mem_f / max(mem_n, 1e-9) <= 0.5 and all(v < 2e-2 for v in rel.values())}


def _smoke_distributed_optimizer(work: Path) -> dict:
    """Megatron's DistributedDataParallel + DistributedOptimizer on a tiny bf16 Qwen2 GPTModel,
    DP = min(2, GPUs) NCCL ranks (child processes, one GPU each), two optimizer steps of 2 then
    3 micro-batches, with the overlapped gradient reduction (CUDA streams) and without: finite
    norms, every parameter moved, and the two runs' weights and norms alike. With one GPU the
    overlap's reductions have no peer (DP=1); tests/megatron/test_ddp.py runs DP=2 on gloo."""
    import importlib.util

    import torch

    if importlib.util.find_spec("megatron") is None:
        return {"ok": True, "skipped": "needs megatron-core (the megatron extra)"}
    world = max(1, min(2, torch.cuda.device_count()))
    runs = {}
    for overlap in (True, False):
        procs, logs = [], [work / f"distributed_optimizer_overlap{int(overlap)}_rank{r}.log" for r in range(world)]
        code = f"from hapo_openrlhf.gpu_smoke import _ddp_step_child; _ddp_step_child({overlap})"
        for rank, log in enumerate(logs):
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29533 + int(overlap)),
                   "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
            with open(log, "w") as f:  # the child keeps its own copy of the descriptor
                procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, env=env))
        try:
            rcs = [p.wait(timeout=600) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            return {"ok": False, "error": f"timed out; see {logs[0]}"}
        lines = logs[0].read_text().strip().splitlines() if logs[0].exists() else []
        try:
            runs[overlap] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            return {"ok": False, "error": f"exit {rcs}; see {logs[0]}"}
        if any(rcs):
            return {"ok": False, "error": f"exit {rcs}; see {logs}"}
    on, off = runs[True], runs[False]
    diff = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(on["checksums"], off["checksums"]))
    ok = all(r["finite"] and r["moved"] == r["params"] for r in runs.values()) and diff < 1e-2
    return {"ok": ok, "dp": world, "grad_norms_overlap": on["grad_norms"], "grad_norms_no_overlap": off["grad_norms"],
            "weights_rel_diff": diff, "state_bytes": on["state_bytes"]}


def _smoke_optimizer_resume(work: Path) -> dict:
    """Megatron's optimizer as this image builds it (Transformer Engine's ``FusedAdam`` when TE
    imports, Apex's, else torch's AdamW) resumes bitwise: :func:`_optimizer_resume` in a child
    process on one GPU, the distributed and the replicated optimizer (docs/megatron.md,
    "Transformer Engine's FusedAdam": on CPU only a stand-in of TE is tested)."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        return {"ok": True, "skipped": "needs megatron-core (the megatron extra)"}
    code = f"from hapo_openrlhf.gpu_smoke import _optimizer_resume_child; _optimizer_resume_child({str(work)!r})"
    rc, res = _one_rank_child(work / "optimizer_resume.log", code, port=29541)
    if rc is None:
        return res
    return {"ok": rc == 0 and all(r["bitwise"] for r in res.values()), **res}


def _one_rank_child(log: Path, code: str, port: int) -> tuple[int | None, dict]:
    """Run ``code`` in a child Python as rank 0 of a one-rank job; it prints one JSON line last.
    (exit code, that object), or (None, a failure naming the log) when no JSON came back."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    rc = _run([sys.executable, "-c", code], log, timeout=600, env=env)
    lines = log.read_text().strip().splitlines() if log.exists() else []
    try:
        return rc, json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return None, {"ok": False, "error": f"exit {rc}; see {log}"}


def _optimizer_resume_child(work: str) -> None:
    res = {f"distributed_{d}": _optimizer_resume("cuda", Path(work) / f"resume_distributed_{d}", distributed=d)
           for d in (True, False)}
    print(json.dumps(res), flush=True)


def _one_rank_job(device: str) -> bool:
    """torch.distributed (from the environment, NCCL on CUDA else gloo) and Megatron's parallel
    state at TP = PP = 1, unless they are up; whether ``device`` is CUDA."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    return cuda


def _optimizer_resume(device: str, ckpt_dir: Path, distributed: bool = True) -> dict:
    """Four optimizer steps of a tiny bf16 Qwen2 GPTModel, against two steps, a checkpoint, and
    two more steps from it in fresh model and optimizer objects: ``bitwise`` when weights, fp32
    masters and moments agree exactly. ``optimizer``: the class megatron-core chose. One rank
    (torch.distributed from the environment unless it is up); ``device="cpu"``: gloo under the
    CPU shim (tests/megatron/test_te_fused_adam.py)."""
    import torch
    from megatron.core import tensor_parallel
    from transformers import Qwen2Config

    from .megatron import checkpoint
    from .megatron.ddp import MegatronOptimizer, wrap
    from .megatron.model import build_qwen2_gpt_model
    from .megatron.schedule import forward_backward

    cuda = _one_rank_job(device)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 512, (2, 32), generator=g).to(device) for _ in range(4)]

    def build():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        torch.manual_seed(0)
        model = build_qwen2_gpt_model(cfg, params_dtype=torch.bfloat16, use_cpu_initialization=not cuda).to(device)
        ddp = wrap(model, distributed_optimizer=distributed)
        return model, ddp, MegatronOptimizer(ddp, lr=1e-2, clip_grad=1.0, weight_decay=0.01)

    def train(ddp, opt, steps):
        for s in steps:
            opt.zero_grad()
            ids = batches[s]
            forward_backward(ddp, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}],
                             lambda lp, en, mb: (-lp.float().sum() / lp.numel(), {}), vocab_size=512)
            opt.step()

    def state(model, opt):
        inner = opt.torch_optimizers[0]
        return ([p.detach().clone() for p in model.parameters()],
                [t.clone() for st in inner.state.values() for k, t in sorted(st.items()) if k != "step"],
                [p.detach().clone() for grp in inner.param_groups for p in grp["params"]])

    model, ddp, opt = build()
    initial = [p.detach().clone() for p in model.parameters()]
    train(ddp, opt, range(4))
    full = state(model, opt)
    model, ddp, opt = build()
    same_start = all(torch.equal(p, w) for p, w in zip(model.parameters(), initial))
    train(ddp, opt, range(2))
    checkpoint.save(ckpt_dir, 2, ddp, opt, {"step": 2})
    model, ddp, opt = build()
    checkpoint.load(checkpoint.latest(ckpt_dir), ddp, opt)
    train(ddp, opt, range(2, 4))
    resumed = state(model, opt)
    inner = opt.torch_optimizers[0]
    return {"optimizer": f"{type(inner).__module__}.{type(inner).__name__}", "same_start": same_start,
            "bitwise": same_start and all(len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
                                          for a, b in zip(full, resumed))}


def _check_in_child(work: Path, check: str, port: int, needs: tuple[str, ...]) -> dict:
    """``gpu_smoke.<check>('cuda')`` in a child Python as a one-rank job on one GPU (its log
    ``work/<check>.log``); skipped, saying so, without the packages in ``needs``."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in needs):
        return {"ok": True, "skipped": f"needs {' and '.join(needs)}"}
    code = f"import json; from hapo_openrlhf.gpu_smoke import {check}; print(json.dumps({check}('cuda')))"
    rc, res = _one_rank_child(work / f"{check}.log", code, port=port)
    if rc is None:
        return res
    return {**res, "ok": rc == 0 and res["ok"]}


def _smoke_te_spec(work: Path) -> dict:
    """Transformer Engine's layer spec on the real TE (docs/megatron.md, "Transformer Engine";
    on CPU only a stand-in of TE is tested): :func:`te_spec_check` in a child process on one GPU."""
    return _check_in_child(work, "te_spec_check", 29543, ("megatron", "transformer_engine"))


def te_spec_check(device: str = "cuda") -> dict:
    """A tiny fp32 Qwen3 (QK-norm) GPTModel built from Transformer Engine's layer spec, loaded
    with the converter's TE names: its log-probs and entropy against the Hugging Face model's
    (packed THD through TE's attention), and the streamed Hugging Face weights against the
    ones it was loaded from (``stream_exact``). One rank of an initialised job (torch.distributed
    from the environment unless it is up); ``device="cpu"`` runs it under the TE stand-in
    (tests/megatron/test_te_spec.py)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from .megatron.convert import gather_hf_state_dict, hf_to_megatron
    from .megatron.model import build_gpt_model
    from .megatron.schedule import logprobs_and_entropy

    cuda = _one_rank_job(device)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=48,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    hf = Qwen3ForCausalLM(cfg).to(device)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.2)
    model = build_gpt_model(cfg, spec="te", perform_initialization=False, use_cpu_initialization=not cuda).to(device)
    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.state_dict(), cfg, spec="te"), strict=False)
    loaded = not unexpected and all(k.endswith("_extra_state") for k in missing)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (3, 40), generator=g).to(device)
    am = torch.ones_like(ids)
    am[1, :9] = 0  # left padding
    am[2, -7:] = 0  # a shorter response
    with torch.no_grad():
        lp, en = logprobs_and_entropy(model, ids, am, vocab_size=512)
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        z = hf(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, :-1].float()
        ref = torch.log_softmax(z, -1)
        ref_lp, ref_en = ref.gather(-1, ids[:, 1:, None]).squeeze(-1), -(ref.exp() * ref).sum(-1)
    valid = (am[:, :-1] * am[:, 1:]).bool()
    lp_err = float((lp[valid] - ref_lp[valid]).abs().max())
    en_err = float((en[valid] - ref_en[valid]).abs().max())
    sd = gather_hf_state_dict(model, cfg)
    ref_sd = hf.state_dict()
    exact = sd is None or all(torch.equal(t, ref_sd[n].cpu()) for n, t in sd.items())
    return {"ok": loaded and exact and lp_err < 2e-3 and en_err < 2e-3, "loaded_strict": loaded,
            "stream_exact": exact, "logprob_max_abs_err": lp_err, "entropy_max_abs_err": en_err}


def _smoke_moe(work: Path) -> dict:
    """A mixture of experts on megatron-core's CUDA path (docs/megatron.md, "Mixture of experts"):
    :func:`moe_check` in a child process on one GPU."""
    return _check_in_child(work, "moe_check", 29544, ("megatron",))


def moe_check(device: str = "cuda") -> dict:
    """A tiny fp32 Qwen3-MoE (4 experts, top-2) GPTModel -- local spec, FlashCoreAttention on packed
    THD rows, megatron-core's all-to-all dispatcher and fp32 router -- against transformers'
    ``Qwen3MoeForCausalLM``: log-probs and entropy, the router statistics of the same forward
    (entropy against the Hugging Face router's), and the streamed Hugging Face weights, experts
    included, against the ones it was loaded from. One rank of an initialised job; ``device="cpu"``
    runs it on gloo (tests/megatron/test_moe.py)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from .megatron.convert import gather_hf_state_dict, hf_to_megatron
    from .megatron.model import build_gpt_model
    from .megatron.moe import reduce_route_stats, to_checkpoint_names
    from .megatron.schedule import forward_backward

    cuda = _one_rank_job(device)
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                         tie_word_embeddings=False)
    hf = Qwen3MoeForCausalLM(cfg).to(device)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.2)
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)  # decisive routing: no near tie between the k-th and the next expert
    model = build_gpt_model(cfg, perform_initialization=False, use_cpu_initialization=not cuda).to(device)
    missing, unexpected = model.load_state_dict(hf_to_megatron(hf.state_dict(), cfg), strict=False)
    loaded = not unexpected and all(k.endswith("_extra_state") for k in missing)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (3, 40), generator=g).to(device)
    am = torch.ones_like(ids)
    am[1, :9] = 0  # left padding
    am[2, -7:] = 0  # a shorter response
    stats: dict = {}
    router_logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: router_logits.append(out[0].detach()))
             for layer in hf.model.layers]
    with torch.no_grad():
        (lp, en), = forward_backward(model, [{"input_ids": ids, "attention_mask": am}], None, vocab_size=512,
                                     forward_only=True, layout="thd", route_stats=stats)
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        z = hf(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, :-1].float()
    for h in hooks:
        h.remove()
    ref = torch.log_softmax(z, -1)
    ref_lp, ref_en = ref.gather(-1, ids[:, 1:, None]).squeeze(-1), -(ref.exp() * ref).sum(-1)
    valid = (am[:, :-1] * am[:, 1:]).bool()
    lp_err = float((lp[valid] - ref_lp[valid]).abs().max())
    en_err = float((en[valid] - ref_en[valid]).abs().max())
    real = am.bool().reshape(-1)
    logp = [torch.log_softmax(x.float()[real], -1) for x in router_logits]
    want_router = float(sum(-(q.exp() * q).sum() for q in logp) / sum(q.shape[0] for q in logp))
    got_router = reduce_route_stats(stats, cfg)["moe/router_entropy"]
    sd = gather_hf_state_dict(model, cfg)
    ref_sd = to_checkpoint_names(hf.state_dict(), cfg)
    exact = sd is None or (set(sd) == set(ref_sd) and all(torch.equal(t, ref_sd[n].cpu()) for n, t in sd.items()))
    router_err = abs(got_router - want_router)
    return {"ok": loaded and exact and lp_err < 2e-3 and en_err < 2e-3 and router_err < 1e-4,
            "loaded_strict": loaded, "stream_exact": exact, "logprob_max_abs_err": lp_err,
            "entropy_max_abs_err": en_err, "router_entropy_abs_err": router_err}


def _smoke_vllm_routes(work: Path) -> dict:
    """Rollout routing replay's engine side on the installed vLLM (docs/megatron.md, "Rollout
    routing replay"): :func:`vllm_routes_check` in a child process (vLLM holds its GPU memory)."""
    return _check_in_child(work, "vllm_routes_check", 29545, ("vllm",))


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

    from .local.model import build_tokenizer

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


def _ddp_step_child(overlap: bool = True) -> None:
    res = _ddp_step("cuda", overlap=overlap)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(res), flush=True)


def _ddp_step(device: str = "cuda", overlap: bool | None = None, dtype: str = "bf16", eps: float = 1e-8) -> dict:
    """The body of :func:`_smoke_distributed_optimizer` on this rank: two optimizer steps, of 2
    then 3 micro-batches of this data-parallel rank's rows (a token budget changes the count
    between steps). ``device="cpu"``: gloo under the CPU shim (tests/megatron/test_ddp.py);
    ``overlap`` defaults to on with CUDA. torch.distributed is set up from the environment
    unless it already is. ``dtype``: the model's (``fp32`` makes runs comparable bitwise;
    bf16 rounding amplifies the reduction order's last bits; so does Adam's ``eps`` 1e-8 on
    near-zero gradients, which a comparison raises). Returns the norms, whether every parameter moved, and a per-parameter
    checksum (fp64 sums) to compare runs."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from transformers import Qwen2Config

    from .megatron.ddp import MegatronOptimizer, wrap
    from .megatron.model import build_qwen2_gpt_model
    from .megatron.schedule import forward_backward

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    pdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = build_qwen2_gpt_model(cfg, params_dtype=pdt, use_cpu_initialization=not cuda).to(device)
    ddp = wrap(model, distributed_optimizer=True, overlap_grad_reduce=cuda if overlap is None else overlap,
               bucket_size=40000)  # several buckets: their reductions start at different times
    # lr 5e-2: Adam's first step is lr x sign(g), above bf16's 2^-7 spacing at 1.0 (norm weights)
    opt = MegatronOptimizer(ddp, lr=5e-2, clip_grad=1.0, eps=eps)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    norms = []
    for n_mb in (2, 3):
        ids = torch.randint(0, 1024, (2 * n_mb * dp, 64), generator=g).to(device)
        mine = ids[rank * 2 * n_mb:(rank + 1) * 2 * n_mb]
        mbs = [{"input_ids": mine[i:i + 2], "attention_mask": torch.ones_like(mine[i:i + 2])}
               for i in range(0, 2 * n_mb, 2)]
        opt.zero_grad()
        denom = ids.shape[0] * 63 / dp  # this replica's share of the global token mean
        forward_backward(ddp, mbs, lambda lp, en, mb: (-lp.sum() / denom, {}), vocab_size=1024)
        norms.append(opt.step())
    moved = sum(int(not torch.equal(before[n], p)) for n, p in model.named_parameters())
    res = {"grad_norm": norms[-1], "grad_norms": norms, "finite": all(torch.isfinite(torch.tensor(norms)).tolist()),
           "moved": moved, "params": len(before), "state_bytes": opt.state_bytes(),
           "checksums": [float(p.detach().double().sum()) for p in model.parameters()]}
    ps.destroy_model_parallel()
    return res


def _smoke_algos() -> dict:
    """Every estimator and loss on CUDA tensors (the device-safety test's CPU proxy, for real)."""
    import torch

    from . import algos

    B, T = 8, 32
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(3)
    inputs = algos.AdvantageInputs(
        rewards=torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 0], device=dev), response_mask=torch.ones(B, T, device=dev),
        entropy=torch.rand(B, T, device=dev, generator=g), group_index=torch.arange(2, device=dev).repeat_interleave(4),
        correct=torch.tensor([1, 0, 0, 1, 1, 1, 0, 0], device=dev, dtype=torch.bool))
    done = []
    for name in algos.list_estimators():
        algos.run_estimator(name, inputs)
        done.append(name)
    lp = -torch.rand(B, T, device=dev, generator=g)
    for name in algos.list_losses():
        kw = {"kl_cov": {"k_ratio": 0.1}, "clip_cov": {"clip_ratio": 0.1, "cov_lb": -9.0, "cov_ub": 9.0},
              "rsi_s": {"lower": 0.1, "upper": 10.0}}.get(name, {})
        algos.compute_policy_loss(name, lp, lp + 0.01, torch.randn(B, T, device=dev, generator=g),
                                  torch.ones(B, T, device=dev), entropy=torch.rand(B, T, device=dev, generator=g),
                                  generator=torch.Generator().manual_seed(0), **kw)
        done.append(name)
    return {"ran": done}


def smoke_table(summary: dict) -> str:
    if not summary.get("cuda"):
        return f"gpu smoke: {summary['error']}"
    rows = ["| check | ok | s | figures |", "|---|---|---|---|"]
    for r in summary["results"]:
        figs = {k: v for k, v in r.items() if k not in ("name", "ok", "wall_s")}
        rows.append(f"| {r['name']} | {'yes' if r['ok'] else 'NO'} | {r['wall_s']} | {json.dumps(figs)} |")
    return "\n".join([f"gpu smoke on {summary['device']} (torch {summary['torch']})", *rows])
