"""LESS (arXiv 2512.00908): low-entropy segments shared across a group's responses.

Source of truth: QWE-CXZ/LESS ``recipe/less/revise_advantage.py`` (``revise_adv`` and its
helpers); the tests mirror it token for token, order included. Per group, with n_right /
n_wrong its correct / wrong responses and each response's valid tokens its leading run of
the mask:

1. tau = the response's sorted entropies at index min(round(0.8 T), T - 1); weight
   1 / n_same (its outcome's count) on tokens with H <= tau, 1 elsewhere.
2. Segments: maximal runs of H < tau of at least ``min_len`` tokens.
3. Each segment (correct responses' first, then wrong ones', in order) that occurs
   contiguously inside a segment of another response (the first such, same order) joins a
   cluster keyed by its token ids: it joins the first cluster whose key it contains, or
   becomes the key of the first cluster it is contained in (that cluster moves to the end),
   or starts one. Each member keeps the positions of the key's first occurrence.
4. A cluster with both outcomes zeroes its members' weights there; otherwise each member's
   weight becomes max(weight, count of its outcome in the cluster / n_same).
5. A' = weight * A for every response whose advantage is not zero.

The reference compares the tokens' strings; this compares token ids (the same unless two
ids decode to one string). It fails on an empty response; here one is left as it is.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Mapping

import torch

from .advantages import ESTIMATORS, AdvantageInputs, AdvantageOutput, grpo_sequence_advantage

Segment = tuple[int, tuple[int, ...], list[int]]  # (member, token ids, positions)


@functools.lru_cache(maxsize=1 << 16)
def _text(toks: tuple[int, ...]) -> str:
    return "," + ",".join(map(str, toks)) + ","


def _find(sub: tuple[int, ...], seq: tuple[int, ...]) -> int:
    """Start of the first contiguous occurrence of ``sub`` in ``seq``, or -1. Searched as
    text (",a,b,c," inside ",x,a,b,c,y,": whole tokens only), so the search runs at C speed:
    the token-by-token scan took 4.5 s for one group of 8 x 4,096 tokens."""
    at = _text(seq).find(_text(sub))
    return -1 if at < 0 else _text(seq).count(",", 0, at)


def _segments(member: int, ids: list[int], h: torch.Tensor, tau: float, min_len: int) -> list[Segment]:
    """Maximal runs of H < tau of at least ``min_len`` tokens (the runs found on the row's tensor)."""
    low = (h < tau).to(torch.int8)
    zero = low.new_zeros(1)
    edge = torch.diff(low, prepend=zero, append=zero)
    starts, ends = (edge == 1).nonzero().flatten().tolist(), (edge == -1).nonzero().flatten().tolist()
    return [(member, tuple(ids[s:e]), list(range(s, e))) for s, e in zip(starts, ends) if e - s >= min_len]


@functools.lru_cache(maxsize=1 << 16)
def _windows(toks: tuple[int, ...], k: int) -> frozenset[tuple[int, ...]]:
    """The k-token windows of ``toks`` (a segment's or key's, looked up again as pairs form)."""
    return frozenset(toks[i:i + k] for i in range(len(toks) - k + 1))


def _clusters(segments: list[Segment], min_len: int) -> dict[tuple[int, ...], tuple[set[int], dict[int, list[int]]]]:
    """Steps 3: key -> (members, member -> positions), in the reference's order.

    The reference scans every other segment for a host, and every cluster key for each pair; a
    sequence can only contain another if it holds the other's first k tokens (k the shortest
    segment's length, at most ``min_len``) as a window, so both scans here visit only the
    segments / keys an index of k-token windows names, in the reference's order (a segment's
    index; a key's insertion number, which an overwritten key keeps, as a dict does). The result
    is the reference's exactly (tests/algos/test_competitors.py holds the full scan as the oracle,
    on random groups)."""
    if not segments:
        return {}
    k = max(1, min(min_len, min(len(t) for _, t, _ in segments)))
    texts = [_text(toks) for _, toks, _ in segments]
    holding: dict[tuple[int, ...], list[int]] = {}  # window -> the segments holding it, in order
    for n, (_, toks, _) in enumerate(segments):
        for w in _windows(toks, k):
            holding.setdefault(w, []).append(n)
    pairs = []
    for n, (seg, text) in enumerate(zip(segments, texts)):
        host = next((segments[o] for o in holding[seg[1][:k]]
                     if segments[o][0] != seg[0] and len(texts[o]) >= len(text) and text in texts[o]), None)
        if host is not None:
            pairs.append((seg, host))
    clusters: dict[tuple[int, ...], tuple[set[int], dict[int, list[int]]]] = {}
    order: dict[tuple[int, ...], int] = {}  # key -> its place in the dict's order
    places = itertools.count()
    by_first: dict[tuple[int, ...], set] = {}  # a key's first window -> keys
    by_window: dict[tuple[int, ...], set] = {}  # any window of a key -> keys

    def add(key, value):
        if key not in clusters:  # a new key goes last; an existing one keeps its place (dict assignment)
            order[key] = next(places)
            by_first.setdefault(key[:k], set()).add(key)
            for w in _windows(key, k):
                by_window.setdefault(w, set()).add(key)
        clusters[key] = value

    def drop(key):
        del clusters[key], order[key]
        by_first[key[:k]].discard(key)
        for w in _windows(key, k):
            by_window[w].discard(key)

    for (m, toks, pos), (hm, htoks, hpos) in pairs:
        if len(toks) < min_len:
            continue
        inside = set().union(*(by_first.get(w, ()) for w in _windows(toks, k)))  # keys toks may hold
        around = by_window.get(toks[:k], set())  # keys that may hold toks
        for key in sorted(inside | around, key=order.__getitem__):
            members, where = clusters[key]
            if (i := _find(key, toks)) >= 0:  # the key lies inside this segment
                j = _find(key, htoks)
                where[m], where[hm] = pos[i:i + len(key)], hpos[j:j + len(key)]
                members.update((m, hm))
                break
            if (i := _find(toks, key)) >= 0:  # this segment lies inside the key: it becomes the key
                for q in where:
                    where[q] = where[q][i:i + len(toks)]
                j = _find(toks, htoks)
                where[m], where[hm] = pos, hpos[j:j + len(toks)]
                members.update((m, hm))
                drop(key)
                add(toks, (members, where))
                break
        else:
            j = _find(toks, htoks)
            add(toks, ({m, hm}, {m: pos, hm: hpos[j:j + len(toks)]}))
    return clusters


def group_weights(ids: list[list[int]], ent: list[torch.Tensor], correct: list[bool], min_len: int,
                  device: torch.device | str = "cpu"):
    """Steps 1-4 for one group: each response's per-token weights (on ``device``), and
    (clusters, mixed). ``ent``: each response's entropies, a float32 CPU tensor of its valid tokens."""
    n = {True: sum(correct), False: len(correct) - sum(correct)}
    weights, segs = [], {True: [], False: []}
    for m, (t_ids, h) in enumerate(zip(ids, ent)):
        T = h.shape[0]
        if not T:
            weights.append(torch.zeros(0, device=device))
            continue
        tau = float(h.sort().values[min(round(T * 0.8), T - 1)])
        w = torch.where(h <= tau, 1.0 / n[correct[m]], 1.0).float()
        weights.append(w.to(device))
        segs[correct[m]] += _segments(m, t_ids, h, tau, min_len)
    clusters = _clusters(segs[True] + segs[False], min_len)
    mixed = 0
    for members, where in clusters.values():
        count = {c: sum(correct[k] == c for k in members) for c in (True, False)}
        both = count[True] and count[False]
        mixed += bool(both)
        for k in members:
            s, e = where[k][0], where[k][-1] + 1
            w = weights[k]
            w[s:e] = 0.0 if both else torch.clamp(w[s:e], min=count[correct[k]] / n[correct[k]])
    return weights, len(clusters), mixed


def _check(p: Mapping[str, Any]) -> None:
    if p["min_len"] < 1:
        raise ValueError(f"less.min_len must be an integer >= 1 (the reference's trace_length is 5), got {p['min_len']}")


@ESTIMATORS.register("less", validate=_check)
def less(inputs: AdvantageInputs, *, min_len: int = 5, eps: float = 1e-6) -> AdvantageOutput:
    """GRPO's advantage reweighted token by token from low-entropy segments a group shares."""
    if inputs.response_ids is None:
        raise ValueError("the less estimator needs the responses' token ids (AdvantageInputs.response_ids)")
    mask = inputs.response_mask.bool()
    A = grpo_sequence_advantage(inputs, eps).float().unsqueeze(-1) * mask
    correct = (inputs.correct.bool() if inputs.correct is not None else A.sum(-1) > 0).tolist()
    lengths = mask.int().cumprod(-1).sum(-1).tolist()  # the leading run of the mask, as the reference counts
    out = A.clone()
    groups = {}
    for i, g in enumerate(inputs.group_index.tolist()):
        groups.setdefault(g, []).append(i)
    n_clusters = n_mixed = zeroed = 0
    # one copy of the token ids and entropies to the host for the whole batch (the matcher runs there),
    # not one per row
    all_ids, all_ent = inputs.response_ids.cpu(), inputs.entropy.detach().float().cpu()
    for rows in groups.values():
        ids = [all_ids[i, :lengths[i]].tolist() for i in rows]
        ent = [all_ent[i, :lengths[i]] for i in rows]
        w, c, mx = group_weights(ids, ent, [correct[i] for i in rows], min_len, device=A.device)
        n_clusters, n_mixed = n_clusters + c, n_mixed + mx
        for i, wi in zip(rows, w):
            if float(A[i].abs().sum()) < 1e-8:  # zero-advantage responses are left as they are
                continue
            out[i] = 0.0
            out[i, :lengths[i]] = A[i, :lengths[i]] * wi
            zeroed += int((wi == 0).sum())
    valid = max(int(mask.sum()), 1)
    return AdvantageOutput(out, metrics={"less/clusters": float(n_clusters), "less/mixed_clusters": float(n_mixed),
                                         "less/zeroed_frac": zeroed / valid})
