"""LESS's host search on tensors (issue 61): for each low-entropy segment, the first segment
of another response of its group that holds its tokens contiguously.

The reference (QWE-CXZ/LESS ``recipe/less/revise_advantage.py``) scans, for each segment in
order, every other segment in order and takes the first of another response that contains it
as a sublist. A segment of L tokens lies inside another exactly when it equals one of the
other's L-token windows, so per distinct length L the batch's L-token windows are hashed
(a polynomial rolling hash of the token ids, two prime moduli below 2^31 so every product
fits in int64, the group folded into each token so groups never meet), sorted by hash --
stably, so equal hashes keep the segments' order -- and each segment's own hash is looked up:
the run of equal hashes it lands in lists, first, the earliest segment holding a window like
it. The host is that segment if it belongs to another response, else the run's first segment
of another response than that one. Every host found is checked token for token against the
segment, so a hash collision can never give a wrong host: a segment whose candidate fails the
check is returned as unsettled (-2) and searched in full by the caller.

Everything runs on the device the token ids are on; the host reads are the set of distinct
lengths and one per length (the windows' count).
"""

from __future__ import annotations

import torch

MODULI = (2_147_483_647, 2_147_483_629)  # primes below 2^31: a hash times a power stays below 2^62
BASE = 1_000_003
UNSETTLED = -2  # a candidate host that failed the token check (a hash collision): search in full


def _powers(n: int, base: int, p: int, device) -> torch.Tensor:
    """[n] base**i mod p, by binary exponentiation over the bits of i (no product above 2^62)."""
    i = torch.arange(n, device=device)
    out = torch.ones(n, dtype=torch.long, device=device)
    cur, bit = base % p, 0
    while (1 << bit) < n:
        out = torch.where(((i >> bit) & 1).bool(), out * cur % p, out)
        cur, bit = cur * cur % p, bit + 1
    return out


def first_hosts(tokens: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, members: torch.Tensor,
                groups: torch.Tensor) -> torch.Tensor:
    """[S] long: for segment s (the segments in the reference's order; segment s is
    ``tokens[offsets[s]:offsets[s] + lengths[s]]``, of response ``members[s]`` in group
    ``groups[s]``), the index of the first segment of its group from another response that
    holds it as a contiguous run of tokens; -1 where none does; ``UNSETTLED`` where the
    hash's candidate failed the token check. Every length must be >= 1."""
    S, device = lengths.numel(), tokens.device
    hosts = torch.full((S,), -1, dtype=torch.long, device=device)
    if S == 0:
        return hosts
    N = tokens.numel()
    seg_of = torch.repeat_interleave(torch.arange(S, device=device), lengths)  # the stream's segment per token
    grp = groups[seg_of]
    keys = []
    for p in MODULI:  # per modulus: prefix sums of x_j B^j, and B^(N - i) to bring a window to one power
        pw = _powers(N + 1, BASE, p, device)
        x = (tokens.long() % p * 7919 + grp * 104_729 + 1) % p
        prefix = torch.cat([x.new_zeros(1), torch.cumsum(x * pw[:N] % p, 0) % p])
        keys.append((prefix, pw))

    def key(start: torch.Tensor, L: int) -> torch.Tensor:  # [n] one int64 per L-token window
        out = None
        for (prefix, pw), p in zip(keys, MODULI):
            h = (prefix[start + L] - prefix[start]) % p * pw[N - start] % p
            out = h if out is None else out * MODULI[1] + h
        return out

    for L in torch.unique(lengths).tolist():
        own = (lengths >= L).nonzero().flatten()  # the segments long enough to hold L tokens, in order
        n_win = lengths[own] - L + 1
        owner = torch.repeat_interleave(own, n_win)
        first = torch.cumsum(n_win, 0) - n_win
        start = offsets[owner] + torch.arange(owner.numel(), device=device) - torch.repeat_interleave(first, n_win)
        wkey, order = torch.sort(key(start, L), stable=True)  # equal hashes keep the segments' order
        owner, start = owner[order], start[order]
        head = torch.ones_like(wkey, dtype=torch.bool)
        head[1:] = wkey[1:] != wkey[:-1]
        run = torch.cumsum(head.long(), 0) - 1
        run_head = torch.nonzero(head).flatten()[run]  # each window's run's first index
        other = members[owner] != members[owner[run_head]]
        big = owner.numel()
        first_other = torch.full((int(run[-1]) + 1,), big, dtype=torch.long, device=device).scatter_reduce(
            0, run, torch.where(other, torch.arange(big, device=device), big), "amin")
        q = (lengths == L).nonzero().flatten()
        at = torch.searchsorted(wkey, key(offsets[q], L))  # the run of q's own hash (q's own window is in it)
        at_other = first_other[run[at]]
        pick = torch.where(members[owner[at]] != members[q], at, at_other)
        found = pick < big
        pick = pick.clamp(max=big - 1)
        host, hstart = owner[pick], start[pick]
        span = torch.arange(L, device=device)
        same = (tokens[offsets[q, None] + span] == tokens[hstart[:, None] + span]).all(-1) & (groups[host] == groups[q])
        hosts[q] = torch.where(found, torch.where(same, host, UNSETTLED), -1)
    return hosts
