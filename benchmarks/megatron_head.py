"""The Megatron back end's last-stage head: fused vocabulary-parallel log-prob + entropy
(``hapo_openrlhf.megatron.head``) against today's logits path, per tensor-parallel rank.

* ``logits``  the output layer's matmul (the hidden states through the tensor-parallel
              copy, times this rank's head shard: the [T, V/TP] fp32 logits shard), then
              ``algos.vocab_parallel_logprobs_entropy`` -- what ``megatron.head: logits`` runs
* ``fused``   ``megatron.head.fused_vocab_parallel_logprobs_entropy`` from the hidden states
              and the head shard, chunk by chunk (no [T, V/TP] tensor)

Forward + backward of ``sum(a * logp + b * entropy)`` (a, b random per token: both
outputs carry gradient) on ``--tp`` gloo processes, fp32 on CPU (bf16 with ``--dtype
bf16``), one method and one length per run. Memory is each rank's peak *extra* RSS
(high-water mark after the step minus after setup: hidden states, head shard, labels);
the reported figure is the larger rank's. Values, the (TP-summed) hidden-state gradient
and weight-gradient rows (the labels' and 1,024 random ones) are compared with the
logits path at ``--tokens``. Prints one line per run; the last line is JSON with
``peak_mem_ratio_vs_unfused``, ``time_ratio_vs_unfused`` and ``max_rel_err`` at
``--tokens``, and ``peak_mem_ratio_by_tokens`` at every ``--lengths``.

    python benchmarks/megatron_head.py [--tokens 8192 --vocab 151936 --hidden 1536 --tp 2
                                        --lengths 2048,4096,8192 --chunk 512 --plot head.png]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

METHODS = ("logits", "fused")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _rank(rank: int, world: int, port: int, method: str, args, out: str, keep: bool) -> None:
    import torch
    import torch.distributed as dist

    from hapo_openrlhf.algos.vocab_parallel import vocab_parallel_logprobs_entropy
    from hapo_openrlhf.megatron.head import _CopyToGroup, fused_vocab_parallel_logprobs_entropy

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    T, V, H = args.length, args.vocab, args.hidden
    Vp = -(-V // world) * world  # the vocabulary padded to a multiple of TP, as Megatron pads it
    Vr = Vp // world
    g = torch.Generator().manual_seed(0)  # every rank draws the same hidden states, labels, weights
    h = torch.randn(T, H, generator=g).mul_(0.05).to(dtype).requires_grad_(True)  # in place: no transient copy
    lab = torch.randint(0, V, (T,), generator=g)
    a, b = torch.randn(T, generator=g), torch.randn(T, generator=g)
    # this rank's head shard, drawn alone: a full [Vp, H] draw here would set the RSS high-water
    # mark above what the heads use, and hide their peak
    w = torch.randn(Vr, H, generator=torch.Generator().manual_seed(1000 + rank)).mul_(0.02).to(dtype)
    w.requires_grad_(True)
    kw = dict(vocab_start=rank * Vr, vocab_size=V, group=dist.group.WORLD, chunk_size=args.chunk)
    dist.barrier()
    base = _rss_mb()
    t0 = time.perf_counter()
    if method == "logits":
        z = _CopyToGroup.apply(h, dist.group.WORLD) @ w.t()  # the output layer: [T, V/TP] logits shard
        lp, en = vocab_parallel_logprobs_entropy(z, lab, **kw)
    else:
        lp, en = fused_vocab_parallel_logprobs_entropy(h, w, lab, **kw)
    (lp * a + en * b).sum().backward()
    dt = time.perf_counter() - t0
    peak = _rss_mb() - base
    res = {"method": method, "tokens": T, "rank": rank, "time_s": dt, "peak_extra_mb": peak}
    saved = {"res": res}
    if keep:  # values and gradients, for compare()
        rows = torch.cat([lab.unique(), torch.randperm(V, generator=torch.Generator().manual_seed(1))[:1024]])
        mine = rows[(rows >= rank * Vr) & (rows < (rank + 1) * Vr)] - rank * Vr
        saved.update(logp=lp.detach(), ent=en.detach(), h=h.grad.float(), w=w.grad[mine].float())
    torch.save(saved, f"{out}.{rank}")
    dist.destroy_process_group()


def run(method: str, length: int, args, out: str, keep: bool) -> dict:
    """One method at one length on ``--tp`` gloo ranks; the slower / larger rank's figures."""
    import torch
    import torch.multiprocessing as mp

    from hapo_openrlhf.cluster.ports import rendezvous_port

    args.length = length
    mp.spawn(_rank, args=(args.tp, rendezvous_port("127.0.0.1"), method, args, out, keep), nprocs=args.tp, join=True)
    per = [torch.load(f"{out}.{r}")["res"] for r in range(args.tp)]
    return {"method": method, "tokens": length, "time_s": max(p["time_s"] for p in per),
            "peak_extra_mb": max(p["peak_extra_mb"] for p in per)}


def _rel_err(x, ref) -> float:
    return float((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30))


def compare(tmp: str, tp: int) -> float:
    """Largest relative error of the fused head against the logits path: values, the
    hidden-state gradient, and every rank's weight-gradient rows."""
    import torch

    err = 0.0
    for r in range(tp):
        got, ref = torch.load(f"{tmp}/fused.{r}"), torch.load(f"{tmp}/logits.{r}")
        err = max(err, *(_rel_err(got[k], ref[k]) for k in ("logp", "ent", "h", "w")))
    return err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--lengths", default="2048,4096,8192", help="token counts for the memory-vs-length ratio")
    # two fp32 [chunk, V/TP] buffers: 0.31 GB at chunk 512, V/TP = 75,968
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--plot", default=None, help="write a PNG of peak extra memory against tokens")
    args = ap.parse_args(argv)
    lengths = sorted({int(x) for x in args.lengths.split(",") if x} | {args.tokens})
    if args.tp < 1 or args.tokens < 1 or min(lengths) < 1:
        raise SystemExit("--tp, --tokens and --lengths must be >= 1")
    res: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in lengths:
            for m in METHODS:
                res[(m, n)] = run(m, n, args, f"{tmp}/{m}" if n == args.tokens else f"{tmp}/{m}-{n}",
                                  keep=n == args.tokens)
                print(f"{m:6s} T={n} V={args.vocab} H={args.hidden} TP={args.tp}: {res[(m, n)]}", flush=True)
        err = compare(tmp, args.tp)

    def ratio(n, key):
        return round(res[("fused", n)][key] / max(res[("logits", n)][key], 1e-9), 4)

    summary = {
        "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "tp": args.tp, "chunk": args.chunk,
        "dtype": args.dtype,
        "peak_mem_ratio_vs_unfused": ratio(args.tokens, "peak_extra_mb"),
        "time_ratio_vs_unfused": ratio(args.tokens, "time_s"),
        "max_rel_err": err,
        "peak_mem_ratio_by_tokens": {str(n): ratio(n, "peak_extra_mb") for n in lengths},
        "peak_extra_mb_by_tokens": {m: {str(n): round(res[(m, n)]["peak_extra_mb"], 1) for n in lengths}
                                    for m in METHODS},
        "time_s": {m: round(res[(m, args.tokens)]["time_s"], 2) for m in METHODS},
    }
    if args.plot:
        _plot(summary, args.plot)
    print(json.dumps(summary))
    return 0


def _plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for m, label in (("logits", "logits path ([T, V/TP] shard)"), ("fused", "fused vocab-parallel head")):
        pts = sorted((int(n), v) for n, v in summary["peak_extra_mb_by_tokens"][m].items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("tokens per micro-batch")
    ax.set_ylabel("peak extra memory per rank (MB)")
    ax.set_title(f"V={summary['vocab']}, H={summary['hidden']}, TP={summary['tp']}, {summary['dtype']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
