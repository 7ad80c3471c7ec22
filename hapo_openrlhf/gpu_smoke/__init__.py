"""``hapo doctor --gpu-smoke``: the one-GPU acceptance run (docs/status.md records each run).

    hapo doctor --gpu-smoke [--json] [--output-dir DIR]

One module per family of checks: ``kernels``, ``optimizer``, ``models``, ``loop``; ``common`` is what
they share. What the CPU tests cannot see: the bf16 fused head against the naive one, the bf16
weight-gradient GEMM (and its in-place accumulation), flash-attn varlen against padded
attention, the algorithms on CUDA, megatron-core's attention against the local one, and
OpenRLHF's loop with a vLLM engine (sleep mode, stop and resume), with DeepSpeed and with
the Megatron actor. Each step reports its own figures and ``ok``; the preflight checks
are in :mod:`hapo_openrlhf.cluster.doctor`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .kernels import (smoke_algos, smoke_flash_varlen, smoke_fused_head, smoke_megatron_attention, smoke_megatron_head,
                      smoke_weight_gemm)
from .loop import smoke_openrlhf_loop, smoke_run_config, smoke_vllm_routes, vllm_routes_check  # noqa: F401
from .models import moe_check, smoke_context_parallel, smoke_moe, smoke_te_spec, te_spec_check  # noqa: F401
# the checks a child process runs by name (common.check_in_child, optimizer.py), and the tests
from .optimizer import (ddp_step, ddp_step_child, optimizer_resume, optimizer_resume_child,  # noqa: F401
                        smoke_distributed_optimizer, smoke_optimizer_resume)


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
    for name, fn in (("fused_head_bf16_vs_naive", smoke_fused_head), ("weight_grad_bf16_gemm", smoke_weight_gemm),
                     ("flash_attn_varlen_vs_padded", smoke_flash_varlen), ("algos_on_cuda", smoke_algos),
                     ("megatron_attention_vs_local", lambda: smoke_megatron_attention(work)),
                     ("megatron_fused_vocab_head_vs_logits", smoke_megatron_head),
                     ("megatron_distributed_optimizer_step", lambda: smoke_distributed_optimizer(work)),
                     ("megatron_optimizer_resume_bitwise", lambda: smoke_optimizer_resume(work)),
                     ("megatron_te_spec_vs_hf", lambda: smoke_te_spec(work)),
                     ("megatron_cp2_te_spec_vs_hf", lambda: smoke_context_parallel(work)),
                     ("megatron_moe_vs_hf", lambda: smoke_moe(work)),
                     ("vllm_routed_experts_vs_hf", lambda: smoke_vllm_routes(work)),
                     ("openrlhf_loop_vllm_sleep_stop_resume", lambda: smoke_openrlhf_loop(work)),
                     ("megatron_tp1_loop", lambda: smoke_openrlhf_loop(work, "megatron"))):
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


def smoke_table(summary: dict) -> str:
    if not summary.get("cuda"):
        return f"gpu smoke: {summary['error']}"
    rows = ["| check | ok | s | figures |", "|---|---|---|---|"]
    for r in summary["results"]:
        figs = {k: v for k, v in r.items() if k not in ("name", "ok", "wall_s")}
        rows.append(f"| {r['name']} | {'yes' if r['ok'] else 'NO'} | {r['wall_s']} | {json.dumps(figs)} |")
    return "\n".join([f"gpu smoke on {summary['device']} (torch {summary['torch']})", *rows])
