"""Megatron core attention: hapo's FlashCoreAttention vs megatron-core's local
DotProductAttention, in a tiny GPTModel stack (forward + backward).

Each (implementation, length) runs in its own subprocess; memory is the peak extra
resident memory of the forward + backward over the process's memory just before it
(CPU; on CUDA the allocator's peak). Prints one line per run, then a JSON summary
as the last line:

* ``peak_mem_ratio_vs_local``: flash / local peak extra memory at ``--seq-len``;
* ``peak_mem_ratio_by_len``: the same at every ``--lengths`` (flash stays linear in
  the length, local grows with its [heads, S, S] scores and [1, 1, S, S] mask);
* ``time_ratio_vs_local``: flash / local wall time of the forward + backward;
* ``thd_vs_padded_max_abs_err``: the next-token log-probs of rows of different
  lengths, packed (THD, varlen) vs padded (right-aligned, causal) -- and vs the local
  attention's masked batch (``thd_vs_masked_max_abs_err``).

    python benchmarks/megatron_attention.py                 # seq-len 8192, lengths 1024..8192
    python benchmarks/megatron_attention.py --seq-len 2048 --lengths 512,1024,2048

On CPU it installs the test tree's CUDA shim (tests/megatron/cuda_shim.py), as the
Megatron tests do.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _setup():
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    if not torch.cuda.is_available():
        from tests.megatron.cuda_shim import install

        install()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(0)


def _config(args):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                       max_position_embeddings=max(args.seq_len, max(args.lengths)) + 8, tie_word_embeddings=False)


def _model(args, attention):
    import torch

    from hapo_openrlhf.megatron.model import build_qwen2_gpt_model

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    return build_qwen2_gpt_model(_config(args), params_dtype=dtype, attention=attention,
                                 use_cpu_initialization=dev == "cpu").to(dev)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _reset_peak_rss() -> bool:
    """Reset the process's resident high-water mark (Linux: ``5`` into ``/proc/self/clear_refs``),
    so the step's peak is measured on its own and not hidden under the imports' or the model
    build's (``ru_maxrss`` never goes down)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    """The resident high-water mark since the last :func:`_reset_peak_rss` (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(args, attention: str, length: int) -> dict:
    """Forward + backward of one row of ``length`` tokens: peak extra MB and seconds."""
    import torch

    from hapo_openrlhf.megatron.schedule import logprobs_and_entropy

    _setup()
    model = _model(args, attention)
    dev = next(model.parameters()).device
    layout = "padded" if attention == "flash" else "masked"
    ids = torch.randint(0, args.vocab, (1, length), device=dev)
    am = torch.ones(1, length, dtype=torch.long, device=dev)

    def step():
        lp, en = logprobs_and_entropy(model, ids, am, vocab_size=args.vocab, layout=layout)
        (lp.sum() + en.sum()).backward()
        model.zero_grad(set_to_none=True)

    small = torch.randint(0, args.vocab, (1, 16), device=dev)  # warm-up: kernels, allocator, grads
    lp, _ = logprobs_and_entropy(model, small, torch.ones_like(small), vocab_size=args.vocab, layout=layout)
    lp.sum().backward()
    model.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _rss_mb()
        _reset_peak_rss()
    t0 = time.perf_counter()
    step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20 - base
    else:
        peak = _peak_rss_mb() - base
    return {"attention": attention, "len": length, "peak_extra_mb": round(peak, 1),
            "seconds": round(time.perf_counter() - t0, 3)}


def run_equivalence(args) -> dict:
    """Log-probs of rows of different lengths: THD vs padded (one model) vs masked (the
    local attention, same weights)."""
    import torch

    from hapo_openrlhf.megatron.schedule import logprobs_and_entropy

    _setup()
    flash, local = _model(args, "flash"), _model(args, "local")
    local.load_state_dict(flash.state_dict())
    dev = next(flash.parameters()).device
    lengths = [args.eq_len, args.eq_len // 2, args.eq_len // 3, 7]
    S = max(lengths)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (len(lengths), S), generator=g).to(dev)
    am = torch.zeros(len(lengths), S, dtype=torch.long, device=dev)
    for i, n in enumerate(lengths):  # left-padded prompts, as rollouts are
        am[i, S - n:] = 1
    valid = (am[:, :-1] * am[:, 1:]).bool()
    with torch.no_grad():
        out = {lay: logprobs_and_entropy(m, ids, am, vocab_size=args.vocab, layout=lay)[0].float()
               for lay, m in (("thd", flash), ("padded", flash), ("masked", local))}
    return {"thd_vs_padded_max_abs_err": float((out["thd"] - out["padded"])[valid].abs().max()),
            "thd_vs_masked_max_abs_err": float((out["thd"] - out["masked"])[valid].abs().max()),
            "eq_lengths": lengths}


def _child(args, what: str, attention: str = "", length: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--child", what, "--attention", attention or "flash", "--length", str(length),
           "--seq-len", str(args.seq_len), "--lengths", ",".join(map(str, args.lengths)), "--hidden", str(args.hidden),
           "--layers", str(args.layers), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
           "--vocab", str(args.vocab), "--eq-len", str(args.eq_len)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout)[-800:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=259)
    ap.add_argument("--eq-len", type=int, default=512, help="longest row of the THD == padded check")
    ap.add_argument("--plot", help="write a memory-vs-length plot (PNG) here")
    ap.add_argument("--child", choices=["run", "eq"])
    ap.add_argument("--attention", default="flash")
    ap.add_argument("--length", type=int, default=0)
    args = ap.parse_args(argv)
    if args.child == "run":
        print(json.dumps(run_one(args, args.attention, args.length)))
        return 0
    if args.child == "eq":
        print(json.dumps(run_equivalence(args)))
        return 0

    lengths = sorted(set(args.lengths) | {args.seq_len})
    res: dict[tuple[str, int], dict] = {}
    for n in lengths:
        for att in ("local", "flash"):
            r = res[(att, n)] = _child(args, "run", att, n)
            print(json.dumps(r), flush=True)
    eq = _child(args, "eq")
    print(json.dumps(eq), flush=True)

    def ratio(n, key):
        a, b = res[("flash", n)], res[("local", n)]
        if "error" in a or "error" in b:
            return None
        return round(a[key] / max(b[key], 1e-9), 4)

    summary = {
        "seq_len": args.seq_len,
        "peak_mem_ratio_vs_local": ratio(args.seq_len, "peak_extra_mb"),
        "time_ratio_vs_local": ratio(args.seq_len, "seconds"),
        "peak_mem_ratio_by_len": {str(n): ratio(n, "peak_extra_mb") for n in lengths},
        "peak_extra_mb_by_len": {att: {str(n): res[(att, n)].get("peak_extra_mb") for n in lengths}
                                 for att in ("flash", "local")},
        "thd_vs_padded_max_abs_err": eq.get("thd_vs_padded_max_abs_err"),
        "thd_vs_masked_max_abs_err": eq.get("thd_vs_masked_max_abs_err"),
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
                  "vocab": args.vocab},
    }
    if args.plot:
        _plot(summary, args.plot)
    print(json.dumps(summary))
    return 0


def _plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for att, label in (("local", "Megatron DotProductAttention (local)"), ("flash", "hapo FlashCoreAttention")):
        pts = sorted((int(n), v) for n, v in summary["peak_extra_mb_by_len"][att].items() if v is not None)
        ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak extra memory, fwd + bwd (MB)")
    m = summary["model"]
    ax.set_title(f"tiny GPTModel (h {m['hidden']}, {m['layers']} layers, {m['heads']} heads), CPU", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
