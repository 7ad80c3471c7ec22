"""Context parallelism's batch split (hapo_openrlhf/megatron/context_parallel.py) against the
upstream code it must agree with: Transformer Engine's ``thd_partition_indices_kernel`` (the CUDA
kernel behind ``tex.thd_get_partitioned_indices``) and verl's ``preprocess_packed_seqs`` /
``postprocess_packed_seqs`` (with ``need_roll``), each restated loop for loop below."""

import random

import pytest
import torch

from hapo_openrlhf.megatron import context_parallel as CP


def te_partition_indices(cu_seqlens, total_tokens, world_size, rank):
    """TE ``thd_partition_indices_kernel`` (transformer_engine/common/fused_attn/context_parallel.cu),
    one thread per output token, with its ``binary_search``."""
    batch = len(cu_seqlens) - 1
    cu_s = [c // world_size for c in cu_seqlens]

    def binary_search(target, array, length):
        left, right = 1, length - 1
        while left < right:
            mid = (left + right) // 2
            if array[mid] <= target:
                left = mid + 1
            else:
                right = mid
        return left - 1

    out = []
    for token_id in range(total_tokens // world_size):
        seq_id = binary_search(token_id, cu_s, batch + 1)
        seq_len = cu_s[seq_id + 1] - cu_s[seq_id]
        index = token_id - cu_s[seq_id]
        offset = rank if index < seq_len // 2 else (world_size - 1) * 2 - rank
        index += cu_s[seq_id] * world_size + seq_len // 2 * offset
        out.append(index)
    return out


def verl_preprocess(seqs, cp, rank, tp):
    """verl ``preprocess_packed_seqs_no_padding`` (models/mcore/util.py) with ``need_roll``: this rank's
    input ids and its rolled labels (a chunk's last label taken from where the sequence continues)."""
    align = tp * cp * 2 if cp > 1 else tp
    lens = [len(s) for s in seqs]
    padded = [n + (align - n % align) % align for n in lens]
    cu_p = [0]
    for n in padded:
        cu_p.append(cu_p[-1] + n)
    ids = [0] * (sum(padded) // cp)
    rolled_fix = {}
    for i, d in enumerate(seqs):
        if cp <= 1:
            ids[cu_p[i]:cu_p[i] + len(d)] = d
            continue
        seqlen = padded[i] // cp
        half = seqlen // 2
        start = cu_p[i] // cp
        ids[start:start + half] = d[half * rank: half * (rank + 1)]
        remain_start = padded[i] - half * (rank + 1)
        remain_end = min(padded[i] - half * rank, len(d))
        remain_len = remain_end - remain_start
        if remain_len > 0:
            ids[start + half: start + half + remain_len] = d[remain_start:remain_end]
        if (rank + 1) * half < len(d):  # verl indexes past the sequence here (an IndexError) when the next
            rolled_fix[start + half - 1] = d[(rank + 1) * half]  # chunk is all padding; that label is masked
        if remain_len > 0:
            rolled_fix[start + half + remain_len - 1] = d[0] if remain_end == len(d) else d[remain_end]
    labels = ids[1:] + ids[:1]
    for k, v in rolled_fix.items():
        labels[k] = v
    return ids, labels


def _seqs(seed, n=5, lo=1, hi=40, vocab=50):
    r = random.Random(seed)
    return [[r.randrange(1, vocab) for _ in range(r.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rank_indices_equal_transformer_engines_partition_kernel(cp, seed):
    lengths = [len(s) for s in _seqs(seed)]
    cu_p = CP.cumulative(CP.padded_lengths(lengths, CP.align_size(cp)))
    seen = []
    for r in range(cp):
        got = CP.rank_indices(cu_p, cp, r).tolist()
        # TE's kernel asserts lengths divisible by 2 x world size, which CP 1 does not pad to: no split there
        assert got == (te_partition_indices(cu_p, cu_p[-1], cp, r) if cp > 1 else list(range(cu_p[-1])))
        seen += got
    assert sorted(seen) == list(range(cu_p[-1]))  # every padded position held by exactly one rank


def test_a_hand_computed_split():
    """One sequence of 6 tokens at CP 2: padded to 8, chunks of 2; rank 0 holds chunks 0 and 3
    (positions 0, 1, 6, 7), rank 1 chunks 1 and 2 (2, 3, 4, 5); the labels are the global next tokens,
    the last real token (position 5) and the padding masked out."""
    s = torch.tensor([11, 12, 13, 14, 15, 16])
    r0, r1 = CP.shard([s], 2, 0), CP.shard([s], 2, 1)
    assert r0.indices.tolist() == [0, 1, 6, 7] and r1.indices.tolist() == [2, 3, 4, 5]
    assert r0.input_ids.tolist() == [11, 12, 0, 0] and r1.input_ids.tolist() == [13, 14, 15, 16]
    assert r0.labels.tolist() == [12, 13, 0, 0] and r1.labels.tolist() == [14, 15, 16, 0]
    assert r0.loss_mask.tolist() == [True, True, False, False] and r1.loss_mask.tolist() == [True, True, True, False]
    assert r0.position_ids.tolist() == [0, 1, 6, 7] and r1.position_ids.tolist() == [2, 3, 4, 5]
    assert (r0.cu_seqlens, r0.cu_seqlens_padded, r0.max_seqlen) == ([0, 6], [0, 8], 8)


@pytest.mark.parametrize("cp,tp", [(2, 1), (2, 2), (4, 1), (4, 2), (1, 2)])
@pytest.mark.parametrize("seed", [0, 3])
def test_ids_and_labels_equal_verls_split_with_its_roll(cp, tp, seed):
    """With sequence parallelism the padding is to 2 x CP x TP, as verl's align_size; the input ids
    equal verl's; the labels on every real token with a next token equal verl's rolled labels."""
    seqs = _seqs(seed, lo=2)
    for r in range(cp):
        sh = CP.shard([torch.tensor(s) for s in seqs], cp, r, tp=tp, sequence_parallel=True)
        ids, labels = verl_preprocess(seqs, cp, r, tp)
        assert sh.input_ids.tolist() == ids
        m = sh.loss_mask
        assert sh.labels[m].tolist() == torch.tensor(labels)[m].tolist()
        align = CP.align_size(cp, tp, sequence_parallel=True)
        assert align == (2 * cp * tp if cp > 1 else tp)
        assert all((b - a) % align == 0 for a, b in zip(sh.cu_seqlens_padded, sh.cu_seqlens_padded[1:]))


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_work_is_the_same_on_every_rank(cp):
    """Chunks r and 2CP-1-r: the keys a rank's queries attend to (position + 1, summed) are equal for
    every rank -- the point of the load-balanced split (a contiguous split would give rank CP-1 the most)."""
    seqs = [torch.arange(n) for n in (37, 8, 100)]
    work = [int((CP.shard(seqs, cp, r).position_ids + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1
    contiguous = [sum(range(r * 50 + 1, (r + 1) * 50 + 1)) for r in range(cp)]
    assert len(set(contiguous)) == cp


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_outputs_gathered_back_equal_the_unsplit_batch(cp):
    """A per-token function of (token, position, label) computed on each rank's share and gathered
    back equals the same function on the whole padded batch -- the CP=N == CP=1 invariant of every
    token-local computation downstream of attention (log-probs against the shard's labels, entropy)."""
    seqs = [torch.tensor(s) for s in _seqs(7, lo=2)]
    one = CP.shard(seqs, 1, 0, tp=1)
    f = lambda sh: (sh.input_ids * 1000 + sh.position_ids * 10 + sh.labels) * sh.loss_mask  # noqa: E731
    parts, cu_p = [], None
    for r in range(cp):
        sh = CP.shard(seqs, cp, r)
        parts.append(f(sh))
        cu_p = sh.cu_seqlens_padded
    back = CP.gather_to_global(parts, cu_p, cp)
    # the same tokens, each at its place in its own sequence (CP pads more than CP=1 does)
    for s, (a, b), (a1, b1) in zip(seqs, zip(cu_p, cu_p[1:]), zip(one.cu_seqlens_padded, one.cu_seqlens_padded[1:])):
        n = s.numel()
        assert back[a:a + n].tolist() == f(one)[a1:a1 + n].tolist()
        assert not back[a + n:b].any()


def test_the_token_budget_counts_per_rank():
    assert CP.tokens_per_rank([6, 10], 2) == (8 + 12) // 2
    assert CP.tokens_per_rank([6, 10], 2, tp=2, sequence_parallel=True) == (8 + 16) // 2
    assert CP.tokens_per_rank([6, 10], 1, tp=2, sequence_parallel=True) == 6 + 10


def test_hostile_sizes_are_named():
    with pytest.raises(ValueError, match="context_parallel must be an integer >= 1"):
        CP.align_size(0)
    with pytest.raises(ValueError, match="tensor_parallel must be an integer >= 1"):
        CP.align_size(2, tp=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        CP.rank_indices([0, 8], 2, 2)
    with pytest.raises(ValueError, match="does not split into 2 x 2 equal chunks"):
        CP.rank_indices([0, 6], 2, 0)
    with pytest.raises(ValueError, match="at least one token"):
        CP.shard([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)], 2, 0)
    with pytest.raises(ValueError, match="one part per context-parallel rank"):
        CP.gather_to_global([torch.zeros(4)], [0, 8], 2)
