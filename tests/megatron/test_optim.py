"""fp32 gradient accumulation for a bf16 Megatron model in Megatron's DDP buffers
(``ddp.wrap``: ``grad_reduce_in_fp32``): over many micro-batches, the accumulated
``main_grad`` equals the fp32 sum of the micro-batches' own gradients; bf16 buffers
(``grad_reduce_in_fp32=False``) are off by more than a percent."""

import torch

from ._dist import init_megatron, load_hf_into, spawn
from .test_convert import tiny_qwen2

N_MB, S = 64, 12


def _rel_err(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b)
    den = sum(float(b[k].pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def _worker(rank, out):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from hapo_openrlhf.megatron.ddp import wrap
    from hapo_openrlhf.megatron.model import build_qwen2_gpt_model
    from hapo_openrlhf.megatron.schedule import forward_backward

    init_megatron()
    hf = tiny_qwen2(False, layers=2)

    def bf16_model():
        model = build_qwen2_gpt_model(hf.config, params_dtype=torch.bfloat16)
        load_hf_into(model, hf)
        return model.to(torch.bfloat16)

    model = bf16_model()
    g = torch.Generator().manual_seed(5)
    mbs = [{"input_ids": torch.randint(0, 259, (1, S), generator=g), "attention_mask": torch.ones(1, S, dtype=torch.long)}
           for _ in range(N_MB)]

    def loss_fn(lp, en, mb):
        return -lp.sum() / (N_MB * (S - 1)), {}

    # the reference: every micro-batch's own bf16 gradient, summed in float64
    ref = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
    for mb in mbs:
        forward_backward(model, [mb], loss_fn, vocab_size=259)
        for n, p in model.named_parameters():
            ref[n] += p.grad.double()
            p.grad = None
    errs = {}
    for fp32 in (True, False):
        model = bf16_model()  # a fresh copy for each wrapper (no hooks left from the other)
        if fp32:  # what the actor uses
            ddp = wrap(model, distributed_optimizer=False)
        else:
            ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=False, overlap_grad_reduce=False, use_distributed_optimizer=False))
        forward_backward(ddp, mbs, loss_fn, vocab_size=259)
        got = {n: p.main_grad.double() for n, p in model.named_parameters()}
        assert all(p.main_grad.dtype == (torch.float32 if fp32 else torch.bfloat16) for p in model.parameters())
        errs[fp32] = _rel_err(got, ref)
    torch.save(errs, out)


def test_bf16_gradients_accumulate_in_fp32_over_many_micro_batches(tmp_path):
    out = tmp_path / "errs.pt"
    spawn(_worker, 1, str(out))
    errs = torch.load(out)
    assert errs[True] < 1e-5, errs  # fp32 sums of the same bf16 micro-batch gradients
    assert errs[False] > 1e-2, errs  # bf16 accumulation over 64: 1.7% here, the error the fp32 buffers remove
