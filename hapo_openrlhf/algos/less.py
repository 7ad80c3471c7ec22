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

import numpy as np
import torch

from .advantages import ESTIMATORS, AdvantageInputs, AdvantageOutput, grpo_sequence_advantage
from .segment_match import UNSETTLED, first_hosts

Segment = tuple[int, tuple[int, ...], range]  # (member: its row, token ids, positions)


@functools.lru_cache(maxsize=1 << 16)
def _text(toks: tuple[int, ...]) -> str:
    return "," + ",".join(map(str, toks)) + ","


def _find(sub: tuple[int, ...], seq: tuple[int, ...]) -> int:
    """Start of the first contiguous occurrence of ``sub`` in ``seq``, or -1. Searched as
    text (",a,b,c," inside ",x,a,b,c,y,": whole tokens only), so the search runs at C speed:
    the token-by-token scan took 4.5 s for one group of 8 x 4,096 tokens."""
    at = _text(seq).find(_text(sub))
    return -1 if at < 0 else _text(seq).count(",", 0, at)


@functools.lru_cache(maxsize=1 << 16)
def _windows(toks: tuple[int, ...], k: int) -> frozenset[tuple[int, ...]]:
    """The k-token windows of ``toks`` (a key's, looked up again as pairs form)."""
    return frozenset(toks[i:i + k] for i in range(len(toks) - k + 1))


def _host_by_scan(segments: list[Segment], n: int) -> int:
    """The reference's host search for segment ``n``, every segment in order (the fallback for a
    hash collision, which :func:`first_hosts` reports as unsettled)."""
    m, toks, _ = segments[n]
    text = _text(toks)
    return next((o for o, (om, otoks, _) in enumerate(segments)
                 if om != m and len(otoks) >= len(toks) and text in _text(otoks)), -1)


Clusters = dict[tuple[int, ...], tuple[set[int], dict[int, range]]]  # key -> (members, member -> positions)


def _clusters(segments: list[Segment], hosts: list[int], min_len: int) -> Clusters:
    """Step 3 for one group: key -> (members, member -> positions), in the reference's order.

    ``hosts[n]``: the index of segment n's host (its first segment of another response holding
    it; -1 none), from :func:`first_hosts`. The reference then scans every cluster key for each
    pair; a key and a segment can only contain one another if one holds the other's first k
    tokens (k the shortest segment's length, at most ``min_len``) as a window, so the scan
    visits only the keys an index of k-token windows names, in the reference's order (a key's
    insertion number, which an overwritten key keeps, as a dict does). The result is the
    reference's exactly (tests/algos/test_competitors.py holds the full scan as the oracle, on
    random groups)."""
    if not segments:
        return {}
    k = max(1, min(min_len, min(len(t) for _, t, _ in segments)))
    clusters: Clusters = {}
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

    for n, h in enumerate(hosts):
        if h == UNSETTLED:
            h = _host_by_scan(segments, n)
        if h < 0:
            continue
        (m, toks, pos), (hm, htoks, hpos) = segments[n], segments[h]
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


def _segments(h: torch.Tensor, valid: torch.Tensor, tau: torch.Tensor, group: torch.Tensor, wrong: torch.Tensor,
              min_len: int):
    """Step 2 for the whole batch: (row, start, length) of each maximal run of H < tau of at least
    ``min_len`` valid tokens, [S] each, in the reference's order -- group by group, the correct
    responses' first, each response's in order."""
    low = ((h < tau[:, None]) & valid).to(torch.int8)
    pad = low.new_zeros(low.shape[0], 1)
    edge = torch.diff(torch.cat([pad, low, pad], -1), dim=-1)
    starts, ends = (edge == 1).nonzero(), (edge == -1).nonzero()  # row-major: rows, then positions, in order
    length = ends[:, 1] - starts[:, 1]
    keep = length >= min_len
    row, start, length = starts[keep, 0], starts[keep, 1], length[keep]
    order = torch.sort(group[row] * 2 + wrong[row].long(), stable=True).indices
    return row[order], start[order], length[order]


def _weights(inputs: AdvantageInputs, valid: torch.Tensor, correct: torch.Tensor, min_len: int):
    """Steps 1-4 for every group: the per-token weights [B, T] (float32, on the host), and the
    counts of clusters and of mixed clusters."""
    B, T = valid.shape
    device = valid.device
    h = inputs.entropy.detach().float()
    n_tok = valid.sum(-1)
    group = torch.unique(inputs.group_index, return_inverse=True)[1]
    n_groups = int(group.max()) + 1 if B else 0
    n_right = torch.zeros(n_groups, dtype=torch.long, device=device).index_add_(0, group, correct.long())
    n_all = torch.bincount(group, minlength=n_groups)
    n_same = torch.where(correct, n_right[group], (n_all - n_right)[group])
    # 1. tau: each response's sorted valid entropies at min(round(0.8 T), T - 1) (Python's round)
    at = torch.tensor([min(round(t * 0.8), t - 1) for t in n_tok.tolist()], device=device).clamp(min=0)
    tau = torch.where(valid, h, torch.inf).sort(-1).values.gather(-1, at[:, None]).squeeze(-1)
    w = torch.where(h <= tau[:, None], (1.0 / n_same.double()).float()[:, None], 1.0).float().cpu()
    # 2-3. the segments, their hosts on the batch's device, then the clusters in the reference's order
    row, start, length = _segments(h, valid, tau, group, ~correct, min_len)
    offsets = torch.cumsum(length, 0) - length
    stream = inputs.response_ids[torch.repeat_interleave(row, length),
                                 torch.repeat_interleave(start - offsets, length) + torch.arange(
                                     int(length.sum()), device=device)]
    hosts = first_hosts(stream, offsets, length, row, group[row])
    tokens = stream.tolist()
    row_l, start_l, len_l, off_l, group_l = (t.tolist() for t in (row, start, length, offsets, group[row]))
    right, n_same_l = correct.tolist(), n_same.tolist()
    w_np = w.numpy()
    n_clusters = n_mixed = 0
    hosts_l = hosts.tolist()
    for g, idx in itertools.groupby(range(len(row_l)), key=group_l.__getitem__):
        idx = list(idx)
        first = idx[0]
        segs = [(row_l[s], tuple(tokens[off_l[s]:off_l[s] + len_l[s]]), range(start_l[s], start_l[s] + len_l[s]))
                for s in idx]
        local = [x - first if x >= 0 else x for x in (hosts_l[s] for s in idx)]
        clusters = _clusters(segs, local, min_len)
        n_clusters += len(clusters)
        # 4. a cluster with both outcomes zeroes its members there; else max(weight, its outcome's share)
        for members, where in clusters.values():
            count = {c: sum(right[r] == c for r in members) for c in (True, False)}
            both = count[True] and count[False]
            n_mixed += bool(both)
            for r in members:
                s, e = where[r][0], where[r][-1] + 1
                if both:
                    w_np[r, s:e] = 0.0
                else:
                    np.maximum(w_np[r, s:e], np.float32(count[right[r]] / n_same_l[r]), out=w_np[r, s:e])
    return w, n_clusters, n_mixed


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
    correct = inputs.correct.bool() if inputs.correct is not None else A.sum(-1) > 0
    valid = mask.int().cumprod(-1).bool()  # the leading run of the mask, as the reference counts
    w, n_clusters, n_mixed = _weights(inputs, valid, correct, min_len)
    w = w.to(A.device)
    moved = (A.abs().sum(-1) >= 1e-8)[:, None]  # zero-advantage responses are left as they are
    out = torch.where(moved, torch.where(valid, A * w, 0.0), A)
    zeroed = int(((w == 0) & valid & moved).sum())
    n_valid = max(int(mask.sum()), 1)
    return AdvantageOutput(out, metrics={"less/clusters": float(n_clusters), "less/mixed_clusters": float(n_mixed),
                                         "less/zeroed_frac": zeroed / n_valid})
