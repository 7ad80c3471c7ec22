"""Megatron's DDP and (distributed) optimizer on the GPU: one step with and without the overlapped
reduction, and a bitwise resume."""

from __future__ import annotations

import json
import os
from pathlib import Path


from .common import one_rank_child, one_rank_job, ranks_child


def smoke_distributed_optimizer(work: Path) -> dict:
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
        code = f"from hapo_openrlhf.gpu_smoke import ddp_step_child; ddp_step_child({overlap})"
        rcs, runs[overlap] = ranks_child(work, f"distributed_optimizer_overlap{int(overlap)}", code, world=world)
        if any(rcs) or "error" in runs[overlap]:
            return {"ok": False, "error": runs[overlap].get("error", f"exit {rcs}; see the logs in {work}")}
    on, off = runs[True], runs[False]
    diff = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(on["checksums"], off["checksums"]))
    ok = all(r["finite"] and r["moved"] == r["params"] for r in runs.values()) and diff < 1e-2
    return {"ok": ok, "dp": world, "grad_norms_overlap": on["grad_norms"], "grad_norms_no_overlap": off["grad_norms"],
            "weights_rel_diff": diff, "state_bytes": on["state_bytes"]}


def smoke_optimizer_resume(work: Path) -> dict:
    """Megatron's optimizer as this image builds it (Transformer Engine's ``FusedAdam`` when TE
    imports, Apex's, else torch's AdamW) resumes bitwise: :func:`optimizer_resume` in a child
    process on one GPU, the distributed and the replicated optimizer (docs/megatron.md,
    "Transformer Engine's FusedAdam": on CPU only a stand-in of TE is tested)."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        return {"ok": True, "skipped": "needs megatron-core (the megatron extra)"}
    code = f"from hapo_openrlhf.gpu_smoke import optimizer_resume_child; optimizer_resume_child({str(work)!r})"
    rc, res = one_rank_child(work / "optimizer_resume.log", code)
    if rc is None:
        return res
    return {"ok": rc == 0 and all(r["bitwise"] for r in res.values()), **res}


def optimizer_resume_child(work: str) -> None:
    res = {f"distributed_{d}": optimizer_resume("cuda", Path(work) / f"resume_distributed_{d}", distributed=d)
           for d in (True, False)}
    print(json.dumps(res), flush=True)


def optimizer_resume(device: str, ckpt_dir: Path, distributed: bool = True) -> dict:
    """Four optimizer steps of a tiny bf16 Qwen2 GPTModel, against two steps, a checkpoint, and
    two more steps from it in fresh model and optimizer objects: ``bitwise`` when weights, fp32
    masters and moments agree exactly. ``optimizer``: the class megatron-core chose. One rank
    (torch.distributed from the environment unless it is up); ``device="cpu"``: gloo under the
    CPU shim (tests/megatron/test_te_fused_adam.py)."""
    import torch
    from megatron.core import tensor_parallel
    from transformers import Qwen2Config

    from ..megatron import checkpoint
    from ..megatron.ddp import MegatronOptimizer, wrap
    from ..megatron.model import build_qwen2_gpt_model
    from ..megatron.schedule import forward_backward

    cuda = one_rank_job(device)
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


def ddp_step_child(overlap: bool = True) -> None:
    res = ddp_step("cuda", overlap=overlap)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(res), flush=True)


def ddp_step(device: str = "cuda", overlap: bool | None = None, dtype: str = "bf16", eps: float = 1e-8) -> dict:
    """The body of :func:`smoke_distributed_optimizer` on this rank: two optimizer steps, of 2
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

    from ..megatron.ddp import MegatronOptimizer, wrap
    from ..megatron.model import build_qwen2_gpt_model
    from ..megatron.schedule import forward_backward

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
