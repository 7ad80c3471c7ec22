"""The cost of the nucleus metric (``rollout/nucleus_logmass``) per old-log-prob pass, as a
ratio to the pass without it (issue 43, item 4), at Qwen's vocabulary V = 151,936.

The old-log-prob pass with the fused head is ``fused_logprobs_entropy`` over the response
tokens (no grad). Under a top-p rollout it also computes log P(nucleus) per token:

* ``sorted``   today's ``sharded_nucleus_logmass``: the rows whose nucleus lies in their top 64
               read from it, the others per chunk one sort and one cumsum over [C', V], then
               40 bisection steps of a binary search per row (``top_k=0``, every row sorted,
               is timed beside it);
* ``masked``   the previous form (kept here to measure it): 40 bisection steps, each a
               full fp32 ``masked_fill`` copy of [C, V] and its boolean mask.

Both from the hidden states and the head (the fused heads' form), chunk 1,024, one process,
fp32, best of ``--repeat``. Printed: each one's time as a ratio to the pass alone, and the
peak extra memory of each metric per chunk as a multiple of one [C, V] fp32 block.

    python benchmarks/nucleus_metric.py [--tokens 2048 --hidden 256 --vocab 151936 --top-p 0.95]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from _embedded import best_of  # benchmarks/_embedded.py (the script's own folder is on sys.path)


def masked_nucleus_logmass(x, top_p, *, weight, chunk_size, steps=40):
    """The previous bisection (one process): a full masked copy per step."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.zeros(flat.shape[0])
    for s in range(0, flat.shape[0], chunk_size):
        z = (flat[s:s + chunk_size] @ weight.t()).float()
        m = z.amax(-1)
        p = torch.exp(z - m.unsqueeze(-1))
        del z
        p.div_(p.sum(-1).unsqueeze(-1))
        lo, hi = torch.zeros_like(m), p.amax(-1)
        for _ in range(steps):
            mid = (lo + hi) / 2
            ok = p.masked_fill(p > mid.unsqueeze(-1), 0).sum(-1) <= 1.0 - top_p
            lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid)
        out[s:s + chunk_size] = p.masked_fill(p <= lo.unsqueeze(-1), 0).sum(-1).log()
    return out


class PeakBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of live tensors created inside the mode (a CPU-visible allocation proxy)."""

    def __init__(self):
        super().__init__()
        import weakref

        self.live, self.peak, self._ref = 0, 0, weakref

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:  # new storage only: in-place ops and views share their input's
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                n = t.untyped_storage().nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                self._ref.finalize(t, self._free, n)  # (a view kept alive past its base is rare here)
        return out

    def _free(self, n):
        self.live -= n


def main() -> None:
    from hapo_openrlhf.algos.fused import fused_logprobs_entropy
    from hapo_openrlhf.algos.nucleus import sharded_nucleus_logmass

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, generator=g)
    w = torch.randn(a.vocab, a.hidden, generator=g) * (3.0 / a.hidden ** 0.5)
    labels = torch.randint(0, a.vocab, (a.tokens,), generator=g)

    def best(fn):
        with torch.no_grad():
            return best_of(fn, a.repeat)

    base = best(lambda: fused_logprobs_entropy(h, w, labels, chunk_size=a.chunk))
    new = best(lambda: sharded_nucleus_logmass(h, a.top_p, weight=w, chunk_size=a.chunk))
    # every row sorted (top_k 0: before issue 61's top-64 reading of the rows whose nucleus fits in it)
    all_sorted = best(lambda: sharded_nucleus_logmass(h, a.top_p, weight=w, chunk_size=a.chunk, top_k=0))
    old = best(lambda: masked_nucleus_logmass(h, a.top_p, weight=w, chunk_size=a.chunk))
    with torch.no_grad():
        diff = float((sharded_nucleus_logmass(h, a.top_p, weight=w, chunk_size=a.chunk)
                      - masked_nucleus_logmass(h, a.top_p, weight=w, chunk_size=a.chunk)).abs().max())
    block = min(a.chunk, a.tokens) * a.vocab * 4
    peaks = {}
    for name, fn in (("sorted", lambda: sharded_nucleus_logmass(h[:a.chunk], a.top_p, weight=w, chunk_size=a.chunk)),
                     ("masked", lambda: masked_nucleus_logmass(h[:a.chunk], a.top_p, weight=w, chunk_size=a.chunk))):
        with torch.no_grad(), PeakBytes() as mode:
            fn()
        peaks[name] = mode.peak / block
    res = {"tokens": a.tokens, "vocab": a.vocab, "top_p": a.top_p, "pass_s": base,
           "with_sorted_metric": (base + new) / base, "with_masked_metric": (base + old) / base,
           "sorted_vs_masked_time": new / old, "with_every_row_sorted": (base + all_sorted) / base,
           "peak_blocks_sorted": peaks["sorted"],
           "peak_blocks_masked": peaks["masked"], "max_abs_diff": diff}
    print(f"old-log-prob pass (fused head, {a.tokens} tokens, V {a.vocab}): {base:.2f} s")
    print(f"  + nucleus metric, sorted (today):    {res['with_sorted_metric']:.2f} x the pass")
    print(f"  + nucleus metric, every row sorted:  {res['with_every_row_sorted']:.2f} x the pass")
    print(f"  + nucleus metric, masked (previous): {res['with_masked_metric']:.2f} x the pass")
    print(f"  peak extra memory per chunk: sorted {peaks['sorted']:.2f}, masked {peaks['masked']:.2f} "
          f"[C, V] fp32 blocks; max |sorted - masked| = {diff:.1e} (ties split vs kept whole)")
    print(json.dumps(res))


if __name__ == "__main__":
    assert not dist.is_initialized()
    main()
