"""The kernels the CPU tests cannot time or run: the fused head in bf16, the weight-gradient
GEMM, flash-attn varlen, megatron-core's attention and the fused vocabulary-parallel head, and
every algorithm on CUDA."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


from .common import peak, run


def smoke_fused_head(tokens: int = 16384, hidden: int = 1536, vocab: int = 151936) -> dict:
    """Fused bf16 head vs the naive [T, V] fp32 logits, forward + backward: values, memory, time."""
    import torch

    from ..algos import fused_logprobs_entropy, logprobs_and_entropy

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

    (a, mem_f, t_f) = peak(fused)
    h.grad = w.grad = None
    (b, mem_n, t_n) = peak(naive)
    err = {k: float((x.float() - y.float()).abs().max()) for k, x, y in zip(("logp", "entropy"), a[:2], b[:2])}
    rel_w = float((a[3].float() - b[3].float()).norm() / b[3].float().norm())
    return {"tokens": tokens, "peak_mib_fused": round(mem_f), "peak_mib_naive": round(mem_n),
            "mem_ratio": round(mem_f / mem_n, 3), "time_ratio": round(t_f / t_n, 3), "max_abs_err": err,
            "weight_grad_rel_err": rel_w, "ok": err["logp"] < 5e-2 and err["entropy"] < 5e-2 and rel_w < 2e-2}


def smoke_weight_gemm() -> dict:
    """The bf16 weight-gradient GEMM (fp32 output) against fp64, its speed against fp32, and
    its in-place accumulation (addmm with out_dtype and out=): two chunks added into one
    [V,H] fp32 buffer equal twice the product and allocate no [V,H] temporary."""
    import torch

    from ..algos.fused import weight_grad_gemm

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


def smoke_flash_varlen() -> dict:
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


def smoke_algos() -> dict:
    """Every estimator and loss on CUDA tensors (the device-safety test's CPU proxy, for real)."""
    import torch

    from .. import algos

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


def smoke_megatron_attention(work: Path) -> dict:
    """benchmarks/megatron_attention.py on the GPU (bf16, flash-attn when installed):
    FlashCoreAttention's peak memory and time vs Megatron's local attention at 8k tokens,
    THD vs padded log-probs. Needs megatron-core and a source checkout (the script)."""
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "megatron_attention.py"
    if importlib.util.find_spec("megatron") is None or not script.is_file():
        return {"ok": True, "skipped": f"needs megatron-core and {script}"}
    log = work / "megatron_attention.log"
    rc = run([sys.executable, str(script), "--seq-len", "8192", "--lengths", "2048,4096,8192", "--hidden", "1024",
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


def smoke_megatron_head(tokens: int = 8192, hidden: int = 1536, vocab: int = 151936) -> dict:
    """The Megatron back end's fused vocabulary-parallel head (megatron/head.py, one rank
    holding the whole vocabulary) against the logits path (bf16 output-layer matmul, then
    the vocabulary-parallel reductions), forward + backward with both outputs carrying
    gradient: peak memory, time, values and gradients. benchmarks/megatron_head.py
    measures the same at TP=2 on CPU/gloo."""
    import torch

    from ..algos.vocab_parallel import vocab_parallel_logprobs_entropy
    from ..megatron.head import fused_vocab_parallel_logprobs_entropy

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

    (x, mem_f, t_f) = peak(lambda: run(True))
    (y, mem_n, t_n) = peak(lambda: run(False))
    rel = {k: float((p - q).norm() / q.norm().clamp(min=1e-30)) for k, p, q in zip(("logp", "entropy", "h", "w"), x, y)}
    return {"tokens": tokens, "peak_mib_fused": round(mem_f), "peak_mib_logits": round(mem_n),
            "mem_ratio": round(mem_f / max(mem_n, 1e-9), 3), "time_ratio": round(t_f / t_n, 3), "rel_err": rel,
            "ok": mem_f / max(mem_n, 1e-9) <= 0.5 and all(v < 2e-2 for v in rel.values())}
