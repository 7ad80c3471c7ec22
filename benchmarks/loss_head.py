"""Loss-head memory and time: naive vs chunked vs fused log-prob + entropy (and verl's).

Methods (forward + backward of sum(a * logp + b * entropy), a and b random per token):

* naive          full fp32 logits [T, V], log_softmax, entropy, autograd backward
* chunked        full logits given, log-prob/entropy chunked under checkpointing (algos.entropy)
* fused          algos.fused.fused_logprobs_entropy: backward recomputes each chunk's logits
* fused_fwdgrad  algos.fused.fused_token_loss: each chunk's gradient computed in the forward (Liger-style)
* verl           verl's published torch FusedLinearForPPO (``pip install --no-deps verl==0.9.1``),
                 its own default chunk 512; skipped with a note when verl is not installed

Each method runs forward + backward in its own subprocess; memory is the peak
*extra* RSS of the loss head: the process's high-water mark after the run minus
the mark after setup (inputs, LM-head weight and a preallocated weight gradient,
which every method needs). Prints one line per method, ratios against the
naive path measured in the same run, and as its last line one JSON object.

    python benchmarks/loss_head.py --tokens 1024 [--vocab 151936 --hidden 1536 --chunk 1024]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _verl_fused_linear():
    """verl's FusedLinearForPPO, loaded from its file alone (verl/__init__ pulls in far more)."""
    import importlib.metadata
    import importlib.util

    path = importlib.metadata.distribution("verl").locate_file("verl/utils/experimental/torch_functional.py")
    spec = importlib.util.spec_from_file_location("verl_torch_functional", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FusedLinearForPPO


def child(method: str, T: int, V: int, H: int, chunk: int, grad_out: str | None = None) -> dict:
    import torch

    from hapo_openrlhf.algos import logprobs_and_entropy
    from hapo_openrlhf.algos.fused import fused_logprobs_entropy, fused_token_loss

    torch.manual_seed(0)
    h = (torch.randn(T, H) * 0.05).requires_grad_(True)
    w = (torch.randn(V, H) * 0.02).requires_grad_(True)
    w.grad = torch.zeros_like(w)  # every method needs the weight gradient: preallocate it
    lab = torch.randint(0, V, (T,))
    a, b = torch.randn(T), torch.randn(T)
    base = _rss_mb()
    t0 = time.perf_counter()
    if method == "naive":
        logp_all = torch.log_softmax((h @ w.t()).float(), -1)
        lp = logp_all.gather(-1, lab.unsqueeze(-1)).squeeze(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)
    elif method == "chunked":
        lp, ent = logprobs_and_entropy(h @ w.t(), lab, chunk_size=chunk)
    elif method == "fused":
        lp, ent = fused_logprobs_entropy(h, w, lab, chunk_size=chunk)
    elif method == "fused_fwdgrad":
        loss, lp, ent = fused_token_loss(h, w, lab, lambda l, e, sl: (l * a[sl] + e * b[sl]).sum(), chunk_size=chunk)
        loss.backward()
    elif method == "verl":
        lp, ent = _verl_fused_linear()(chunk_size=512)(h, w, lab)
    else:
        raise SystemExit(f"unknown method {method!r}")
    if method != "fused_fwdgrad":
        (lp * a + ent * b).sum().backward()
    dt = time.perf_counter() - t0
    peak = _rss_mb() - base
    if grad_out:  # hidden gradient, the weight-gradient rows of the labels and of 1024 random ids
        rows = torch.cat([lab.unique(), torch.randperm(V, generator=torch.Generator().manual_seed(1))[:1024]])
        torch.save({"h": h.grad, "w": w.grad[rows], "logp": lp.detach(), "ent": ent.detach()}, grad_out)
    return {"method": method, "time_s": dt, "peak_extra_mb": peak}


def _rel_err(x, ref) -> float:
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=1536)
    # two fp32 [chunk, V] buffers: 0.31 GB at chunk 256 and V = 151,936
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--methods", default="naive,chunked,fused,fused_fwdgrad,verl")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--grad-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.hidden, args.chunk, args.grad_out)))
        return
    import torch

    tmp = tempfile.TemporaryDirectory()
    res = {}
    for m in args.methods.split(","):
        cmd = [sys.executable, __file__, "--child", m, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
               "--hidden", str(args.hidden), "--chunk", str(args.chunk), "--grad-out", f"{tmp.name}/{m}.pt"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            res[m] = {"method": m, "error": out.stderr.strip().splitlines()[-1] if out.stderr else f"rc {out.returncode}"}
        else:
            res[m] = json.loads(out.stdout.strip().splitlines()[-1])
            if m != "naive" and "time_s" in res.get("naive", {}):
                # same seed, same inputs: compare values and gradients with the naive path's
                got, ref = torch.load(f"{tmp.name}/{m}.pt"), torch.load(f"{tmp.name}/naive.pt")
                res[m]["max_rel_err"] = max(_rel_err(got[k], ref[k]) for k in ref)
        print(f"{m:8s} T={args.tokens} V={args.vocab} H={args.hidden}: {res[m]}", flush=True)
    summary = {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "chunk": args.chunk}
    for m, r in res.items():
        summary[f"{m}_time_s"] = r.get("time_s")
        summary[f"{m}_peak_extra_mb"] = r.get("peak_extra_mb")
        if "max_rel_err" in r:
            summary[f"{m}_max_rel_err_vs_naive"] = r["max_rel_err"]
    naive = res.get("naive", {})
    for m in ("chunked", "fused", "fused_fwdgrad", "verl"):
        if m in res and "time_s" in res[m] and "time_s" in naive:
            summary[f"time_ratio_{m}_vs_naive"] = res[m]["time_s"] / naive["time_s"]
            summary[f"mem_ratio_{m}_vs_naive"] = res[m]["peak_extra_mb"] / max(naive["peak_extra_mb"], 1e-9)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
