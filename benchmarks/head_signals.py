"""PAEC's head signals (nucleus entropy + top-two gap, ``sharded_nucleus_stats``) and the nucleus
metric (``sharded_nucleus_logmass``) as a ratio to the fused head's log-prob + entropy forward on
the same rows (issue 61), each with the top-k path (today: the rows whose nucleus lies in the top
``TOP_K`` read from it, the others sorted) and with every row sorted (``top_k=0``, before), in
one run, one process, fp32, from hidden states and the head (the fused heads' form), chunk 1,024.

Two kinds of rows, printed with their nucleus sizes and entropies:
* ``peaked``: each row's hidden state carries four candidate tokens (random rows of the head): the
  first raised by c ~ U(``--boost-lo``, ``--boost-hi``) nats over the N(0, 1) logits, the other
  three by c - U(0, ``--spread``): most positions near-certain, some forking between a few
  candidates -- measured at the defaults, entropy median ~0.13 nats, ~46% below 0.1, 80th
  percentile ~0.6 (the 80/20 paper's CoT tokens: the 80th percentile at 0.672), a nucleus of
  one token at the median, nearly all within the top 64;
* ``flat``: unscaled (logits ~ N(0, 1) over the whole vocabulary, entropy near log V): every
  nucleus holds most of the vocabulary, every row falls to the sort -- the worst case.

    python benchmarks/head_signals.py [--tokens 1024 --hidden 256 --vocab 32768 --top-p 0.9]
"""

from __future__ import annotations

import argparse
import json

import torch

from _embedded import best_of, peaked_hidden  # benchmarks/_embedded.py (the script's own folder is on sys.path)


def main() -> None:
    from hapo_openrlhf.algos.fused import fused_logprobs_entropy
    from hapo_openrlhf.algos.nucleus import TOP_K, nucleus_mask, sharded_nucleus_logmass, sharded_nucleus_stats

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--boost-lo", type=float, default=15.0)
    ap.add_argument("--boost-hi", type=float, default=27.0)
    ap.add_argument("--spread", type=float, default=24.0)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    out = {"tokens": a.tokens, "hidden": a.hidden, "top_p": a.top_p, "top_k": TOP_K, "runs": []}
    for V in a.vocab:
        g = torch.Generator().manual_seed(0)
        h = torch.randn(a.tokens, a.hidden, generator=g)
        w = torch.randn(V, a.hidden, generator=g) / a.hidden ** 0.5
        labels = torch.randint(0, V, (a.tokens,), generator=g)
        peaked = peaked_hidden(h, w, g, a.boost_lo, a.boost_hi, a.spread)
        for kind, x in (("peaked", peaked), ("flat", h)):
            with torch.no_grad():
                best = lambda fn: best_of(fn, a.repeat)  # noqa: E731
                head = best(lambda: fused_logprobs_entropy(x, w, labels, chunk_size=a.chunk))
                sig = {k: best(lambda k=k: sharded_nucleus_stats(x, a.top_p, weight=w, chunk_size=a.chunk,
                                                                 entropy=True, top2_gap=True, top_k=k))
                       for k in (TOP_K, 0)}
                met = {k: best(lambda k=k: sharded_nucleus_logmass(x, a.top_p, weight=w, chunk_size=a.chunk, top_k=k))
                       for k in (TOP_K, 0)}
                top = sharded_nucleus_stats(x, a.top_p, weight=w, chunk_size=a.chunk, entropy=True)
                srt = sharded_nucleus_stats(x, a.top_p, weight=w, chunk_size=a.chunk, entropy=True, top_k=0)
                logits = x[:256] @ w.t()
                size = nucleus_mask(logits, a.top_p).sum(-1).float()
                full_h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
            row = {"vocab": V, "rows": kind, "head_ms": head * 1e3,
                   "signals_ms": sig[TOP_K] * 1e3, "signals_sorted_ms": sig[0] * 1e3,
                   "signals_ratio": sig[TOP_K] / head, "signals_sorted_ratio": sig[0] / head,
                   "metric_ms": met[TOP_K] * 1e3, "metric_sorted_ms": met[0] * 1e3,
                   "metric_ratio": met[TOP_K] / head, "metric_sorted_ratio": met[0] / head,
                   "max_abs_entropy": float((top.entropy - srt.entropy).abs().max()),
                   "max_abs_logmass": float((top.logmass - srt.logmass).abs().max()),
                   "nucleus_in_top_k_frac": float((size <= TOP_K).float().mean()),
                   "nucleus_size_median": float(size.median()), "entropy_median": float(full_h.median()),
                   "entropy_below_0.1_frac": float((full_h < 0.1).float().mean()),
                   "entropy_p80": float(full_h.quantile(0.8))}
            out["runs"].append(row)
            print(f"V {V:6d} {kind:6s}: head {row['head_ms']:8.1f} ms | signals {row['signals_ratio']:5.2f}x "
                  f"(sorted {row['signals_sorted_ratio']:5.2f}x) | metric {row['metric_ratio']:5.2f}x "
                  f"(sorted {row['metric_sorted_ratio']:5.2f}x) | nucleus <= {TOP_K}: "
                  f"{row['nucleus_in_top_k_frac']:.2f}, median size {row['nucleus_size_median']:.0f}, entropy "
                  f"median {row['entropy_median']:.3f}, < 0.1: {row['entropy_below_0.1_frac']:.2f}, p80 "
                  f"{row['entropy_p80']:.2f} | max |top - sorted| H {row['max_abs_entropy']:.1e}, "
                  f"log P(S) {row['max_abs_logmass']:.1e}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
