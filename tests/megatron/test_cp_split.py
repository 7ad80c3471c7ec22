"""Context parallelism's batch split (hapo_openrlhf/megatron/context_parallel.py) against the
upstream code it must agree with: Transformer Engine's ``thd_partition_indices_kernel`` (the CUDA
kernel behind ``tex.thd_get_partitioned_indices``) and verl's ``preprocess_packed_seqs`` /
``postprocess_packed_seqs`` (with ``need_roll``), each restated loop for loop below; and the TE
stand-in's context-parallel attention fed that split. No megatron-core API: megatron-core's model,
schedule, optimizer and checkpoints under CP are test_context_parallel.py's."""

import random
from pathlib import Path

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


# ------------------------------------------- the TE stand-in's context-parallel attention (issue 58)
LENGTHS = [3, 13, 6, 1]  # uneven; 3 and 1 are shorter than 2 x CP chunks of padding (mostly padding)


def _cp_attention_worker(rank, out_dir):
    """On 2 CP ranks: the stand-in's DotProductAttention with ``cp_group`` on each rank's share (hapo's
    split) equals the unsplit attention at that share's tokens -- output and the gradients of Q, K and V
    -- for every comm type it takes, with GQA and with a non-causal padding mask; the refusals named."""
    import json

    import torch.distributed as dist
    from transformer_engine.pytorch import DotProductAttention

    torch.manual_seed(0)  # the same batch on both ranks
    seqs = [torch.randint(0, 50, (n,)) for n in LENGTHS]
    mine = CP.shard(seqs, 2, rank)
    assert mine.cu_seqlens_padded == [0, 4, 20, 28, 32]  # padded to multiples of 2 x CP
    cu, cu_p = torch.tensor(mine.cu_seqlens, dtype=torch.int32), torch.tensor(mine.cu_seqlens_padded,
                                                                              dtype=torch.int32)
    total, heads, kv_heads, d = cu_p[-1].item(), 4, 2, 8
    checked = {}
    for mask_type in ("padding_causal", "padding"):
        q, k, v = (torch.randn(total, h, d, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
        w = torch.randn(total, heads * d, dtype=torch.float64)
        ref = DotProductAttention(heads, d, num_gqa_groups=kv_heads, qkv_format="thd", attn_mask_type=mask_type)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        # the unsplit batch through the same stand-in without CP (real lengths, the CP padding kept)
        out_ref = ref(qr, kr, vr, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p,
                      cu_seqlens_kv_padded=cu_p)
        (out_ref * w).sum().backward()
        idx = mine.indices
        for comm in ("p2p", "all_gather", "a2a"):
            attn = DotProductAttention(heads, d, num_gqa_groups=kv_heads, qkv_format="thd", attn_mask_type=mask_type,
                                       cp_group=dist.group.WORLD, cp_global_ranks=[0, 1], cp_comm_type=comm)
            ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
            out = attn(ql, kl, vl, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p,
                       cu_seqlens_kv_padded=cu_p)
            assert out.shape == (total // 2, heads * d)
            torch.testing.assert_close(out, out_ref[idx].detach(), rtol=0, atol=1e-12)
            (out * w[idx]).sum().backward()  # both ranks: the gathered K / V's gradient is summed over them
            for got, want in ((ql, qr), (kl, kr), (vl, vr)):
                torch.testing.assert_close(got.grad, want.grad[idx], rtol=0, atol=1e-12)
            checked[f"{mask_type}/{comm}"] = {"tokens": int(idx.numel()),
                                              "zero_rows": int((out.abs().sum(-1) == 0).sum())}
    # refused: CP on sbhd by name, as the stand-in does not compute it; a2a+p2p on THD with TE's own
    # assertions (a list of two groups; THD not supported by the hierarchical implementation)
    for kw, says, err in (({"cp_comm_type": "a2a+p2p", "cp_group": [dist.group.WORLD, dist.group.WORLD]},
                           "thd format is not supported with hierarchical CP implementation yet!", AssertionError),
                          ({"cp_comm_type": "a2a+p2p"}, "requires cp_group = [a2a_cp_group, p2p_cp_group]",
                           AssertionError),
                          ({"qkv_format": "sbhd"}, "sbhd", NotImplementedError)):
        args = {"qkv_format": "thd", "attn_mask_type": "padding_causal", "cp_group": dist.group.WORLD,
                "cp_global_ranks": [0, 1], **kw}
        try:
            a = DotProductAttention(heads, d, num_gqa_groups=kv_heads, **args)
            a(q[idx].float(), k[idx].float(), v[idx].float(), cu_seqlens_q=cu, cu_seqlens_q_padded=cu_p)
        except err as e:
            assert says in str(e), e
        else:
            raise AssertionError(f"{kw} was not refused")
    try:
        DotProductAttention(heads, d, qkv_format="thd", attn_mask_type="causal", cp_group=dist.group.WORLD)(
            q[idx].float(), q[idx].float(), q[idx].float(), cu_seqlens_q=cu, cu_seqlens_q_padded=cu_p)
    except ValueError as e:
        assert "THD format requires padding mask type" in str(e)
    else:
        raise AssertionError("THD with a causal (not padding_causal) mask under CP was not refused")
    if rank == 0:
        (Path(out_dir) / "checked.json").write_text(json.dumps(checked))


def test_the_te_stand_ins_cp_attention_equals_one_rank_at_each_shards_tokens(tmp_path):
    """Issue 58's CP attention on the Transformer Engine stand-in, fed hapo's split: equal to CP=1."""
    import json

    from tests.megatron._dist import spawn_te

    spawn_te("tests.megatron.test_cp_split:_cp_attention_worker", 2, str(tmp_path))
    checked = json.loads((tmp_path / "checked.json").read_text())
    assert sorted(checked) == sorted(f"{m}/{c}" for m in ("padding_causal", "padding") for c in ("p2p", "all_gather",
                                                                                                  "a2a"))
    # rank 0 holds 16 of the 32 padded tokens, of which the padding rows are zero (TE fills them so)
    assert all(v["tokens"] == 16 and v["zero_rows"] > 0 for v in checked.values())
