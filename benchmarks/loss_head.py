"""Loss-head memory and time: naive vs chunked vs fused log-prob + entropy.

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
import time


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(method: str, T: int, V: int, H: int, chunk: int) -> dict:
    import torch

    from hapo_openrlhf.algos import logprobs_and_entropy
    from hapo_openrlhf.algos.fused import fused_logprobs_entropy

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
    else:
        lp, ent = fused_logprobs_entropy(h, w, lab, chunk_size=chunk)
    (lp * a + ent * b).sum().backward()
    dt = time.perf_counter() - t0
    return {"method": method, "time_s": dt, "peak_extra_mb": _rss_mb() - base}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--methods", default="naive,chunked,fused")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.vocab, args.hidden, args.chunk)))
        return
    res = {}
    for m in args.methods.split(","):
        cmd = [sys.executable, __file__, "--child", m, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
               "--hidden", str(args.hidden), "--chunk", str(args.chunk)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            res[m] = {"method": m, "error": out.stderr.strip().splitlines()[-1] if out.stderr else f"rc {out.returncode}"}
        else:
            res[m] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{m:8s} T={args.tokens} V={args.vocab} H={args.hidden}: {res[m]}", flush=True)
    summary = {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "chunk": args.chunk}
    for m, r in res.items():
        summary[f"{m}_time_s"] = r.get("time_s")
        summary[f"{m}_peak_extra_mb"] = r.get("peak_extra_mb")
    naive = res.get("naive", {})
    for m in ("chunked", "fused"):
        if m in res and "time_s" in res[m] and "time_s" in naive:
            summary[f"time_ratio_{m}_vs_naive"] = res[m]["time_s"] / naive["time_s"]
            summary[f"mem_ratio_{m}_vs_naive"] = res[m]["peak_extra_mb"] / max(naive["peak_extra_mb"], 1e-9)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
