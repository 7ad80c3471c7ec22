"""The methods HAPO competes with (SPEC 2.8, issue 39): eapo_entropic and pepo against what
their sources compute, their invariants, and the methods refused by name.

The EAPO reference is wgcyeo/EAPO ``src/trainers/eapo_trainer.py``; the functions below
marked "mirrors" restate, loop by loop, what its ``_linear_quantile``,
``normalize_token_entropies``, ``eapo_token_advantages`` and the kappa schedule in
``_generate_and_score_completions`` compute (read with the search tool, not copied). PEPO
publishes no code: its oracle is the paper's formula evaluated with numpy (``np.pad``
with ``mode="reflect"`` and an explicit window sum)."""

import math

import numpy as np
import pytest
import torch

from hapo_openrlhf import algos
from hapo_openrlhf.algos.advantages import grpo_sequence_advantage
from hapo_openrlhf.algos.eapo import kappa_at, linear_quantile
from hapo_openrlhf.algos.pepo import window_softmax
from hapo_openrlhf.config import load_config

from ..conftest import REPO


def _batch(seed: int, groups: int = 3, G: int = 4, T: int = 11, binary: bool = True):
    """Several groups, uneven lengths (right padding holding garbage), mixed outcomes."""
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    entropy = torch.rand(B, T, generator=g) * 3
    entropy[~mask] = float("nan")  # padding never enters any statistic
    rewards = (torch.rand(B, generator=g) > 0.5).float() if binary else torch.randn(B, generator=g)
    rewards[:G] = 1.0  # one all-correct group: A = 0 there
    return algos.AdvantageInputs(rewards=rewards, response_mask=mask, entropy=entropy,
                                 group_index=torch.arange(B) // G, correct=rewards > 0.5)


# ------------------------------------------------------------------------- EAPO
def _mirror_linear_quantile(values: list[float], q: float) -> float:
    """mirrors eapo_trainer.py ``_linear_quantile``: the (k+1)-th smallest at floor/ceil of
    q (n - 1), linearly interpolated."""
    v = sorted(values)
    rank = q * (len(v) - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


def _mirror_eapo(A: list[float], H: torch.Tensor, mask: torch.Tensor, kappa: float) -> torch.Tensor:
    """mirrors eapo_trainer.py ``normalize_token_entropies`` then ``eapo_token_advantages``
    (one row at a time, in float64)."""
    valid = [float(H[i, t]) for i in range(H.shape[0]) for t in range(H.shape[1]) if mask[i, t]]
    q10, q90 = _mirror_linear_quantile(valid, 0.1), _mirror_linear_quantile(valid, 0.9)
    out = torch.zeros(H.shape, dtype=torch.float64)
    for i in range(H.shape[0]):
        ts = [t for t in range(H.shape[1]) if mask[i, t]]
        h = [min(max((float(H[i, t]) - q10) / (q90 - q10 + 1e-8), 0.0), 1.0) for t in ts]
        sign = (A[i] > 0) - (A[i] < 0)
        raw = [math.exp(kappa * sign * x) for x in h]
        mean = sum(raw) / max(len(raw), 1)
        for t, r in zip(ts, raw):
            out[i, t] = A[i] * r / max(mean, 1e-8)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_eapo_equals_the_reference_computation(seed):
    inputs = _batch(seed, binary=seed % 2 == 0)
    out = algos.run_estimator("eapo_entropic", inputs)
    A = grpo_sequence_advantage(inputs).tolist()
    want = _mirror_eapo(A, inputs.entropy, inputs.response_mask, math.log(4.0))
    torch.testing.assert_close(out.advantages.double(), want, rtol=1e-5, atol=1e-6)
    assert out.metrics["eapo/kappa"] == pytest.approx(math.log(4.0))


def test_linear_quantile_is_numpys_linear_percentile():
    x = torch.rand(1001, generator=torch.Generator().manual_seed(0))
    for q in (0.0, 0.1, 0.37, 0.9, 1.0):
        assert float(linear_quantile(x, q)) == pytest.approx(float(np.percentile(x.numpy(), 100 * q)), abs=1e-6)
        assert float(linear_quantile(x[:7], q)) == pytest.approx(_mirror_linear_quantile(x[:7].tolist(), q), abs=1e-7)


@pytest.mark.parametrize("seed", range(4))
def test_eapo_keeps_each_responses_mean_and_kappa_zero_is_grpo(seed):
    inputs = _batch(seed, binary=False)
    mask = inputs.mask
    A = grpo_sequence_advantage(inputs)
    out = algos.run_estimator("eapo_entropic", inputs).advantages
    n = mask.sum(-1)
    torch.testing.assert_close((out * mask).sum(-1) / n, A, rtol=1e-5, atol=1e-6)  # mean kept per response
    grpo = algos.run_estimator("grpo", inputs).advantages
    assert torch.equal(algos.run_estimator("eapo_entropic", inputs, kappa=0.0).advantages, grpo)
    assert torch.equal(out[A == 0], torch.zeros_like(out[A == 0]))  # A_i = 0 stays 0
    # failures weight their lowest-entropy tokens most; successes their highest (within the clamp)
    for i in torch.nonzero(A != 0).flatten().tolist():
        ts = mask[i].bool()
        if ts.sum() < 2:
            continue
        H, w = inputs.entropy[i][ts], out[i][ts] / A[i]
        lo, hi = int(H.argmin()), int(H.argmax())
        assert (w[hi] >= w[lo]) if A[i] > 0 else (w[lo] >= w[hi])
        assert float(w.max() / w.min()) <= 4.0 + 1e-4  # kappa = ln 4: at most a 4x weight ratio


def test_eapo_kappa_decays_linearly_with_the_optimizer_step():
    """mirrors the schedule in ``_generate_and_score_completions``: kappa (1 - min(step / K, 1))."""
    k = math.log(4.0)
    assert [kappa_at(k, 10, s) for s in (0, 5, 10, 20)] == pytest.approx([k, k / 2, 0.0, 0.0])
    assert kappa_at(k, 0, None) == k
    inputs = _batch(0)
    half = algos.AdvantageInputs(**{**inputs.__dict__, "step": 5})
    torch.testing.assert_close(algos.run_estimator("eapo_entropic", half, decay_steps=10).advantages,
                               algos.run_estimator("eapo_entropic", inputs, kappa=k / 2).advantages)
    with pytest.raises(ValueError, match="needs the optimizer step"):
        algos.run_estimator("eapo_entropic", inputs, decay_steps=10)


# ------------------------------------------------------------------------- PEPO
def _numpy_window(h: np.ndarray, window: int, temp: float) -> np.ndarray:
    """The paper's e_t: exp(H_t / temp) over the sum of exp in the centred window, ends reflected."""
    half = window // 2
    x = np.exp(h / temp)
    padded = np.pad(x, (half, half), mode="reflect") if len(h) > 1 else np.full(len(h) + 2 * half, x[0])
    return np.array([x[t] / padded[t:t + window].sum() for t in range(len(h))])


def test_pepo_windows_by_hand():
    # H = [0, ln 2, 0], window 3: exp = [1, 2, 1], reflected ends -> [2, 1, 2, 1, 2]
    e = window_softmax(torch.tensor([0.0, math.log(2.0), 0.0]), 3, 1.0)
    torch.testing.assert_close(e.double(), torch.tensor([1 / 5, 2 / 4, 1 / 5], dtype=torch.float64))
    # a window longer than the response: H = [0, ln 3], window 5 -> padded [1, 3, 1, 3, 1, 3]
    e = window_softmax(torch.tensor([0.0, math.log(3.0)]), 5, 1.0)
    torch.testing.assert_close(e.double(), torch.tensor([1 / 9, 3 / 11], dtype=torch.float64))
    # both edges at temperature 2, window 5 over 4 tokens, against numpy
    h = np.array([0.3, 1.7, 0.2, 2.5])
    torch.testing.assert_close(window_softmax(torch.tensor(h), 5, 2.0).double(),
                               torch.tensor(_numpy_window(h, 5, 2.0)))
    assert float(window_softmax(torch.tensor([0.7]), 101, 1.0)) == pytest.approx(1 / 101)


@pytest.mark.parametrize("seed", range(5))
def test_pepo_equals_the_formula_keeps_the_sum_and_leaves_failures(seed):
    inputs = _batch(seed, T=40)
    window = (3, 7, 101)[seed % 3]
    out = algos.run_estimator("pepo", inputs, window=window, temperature=0.8)
    A = grpo_sequence_advantage(inputs)
    mask = inputs.response_mask
    for i in range(len(A)):
        m = mask[i]
        if not bool(inputs.correct[i]):
            torch.testing.assert_close(out.advantages[i], A[i] * mask[i].float())  # failures unchanged
            continue
        e = _numpy_window(inputs.entropy[i][m].double().numpy(), window, 0.8)
        c = e * m.sum().item() / e.sum()
        torch.testing.assert_close(out.advantages[i][m].double(), float(A[i]) * torch.tensor(c), rtol=1e-5, atol=1e-6)
        if A[i] != 0:
            assert float(out.advantages[i][m].sum() / A[i]) == pytest.approx(int(m.sum()), rel=1e-5)  # sum c = T
        assert torch.equal(out.advantages[i][~m], torch.zeros_like(out.advantages[i][~m]))


# ------------------------------------------------------------------------- refusals and hostile values
@pytest.mark.parametrize("name", ["ep_grpo", "papo", "erpo", "ces"])
def test_methods_without_a_formulation_are_refused_by_name(name):
    with pytest.raises(ValueError, match=rf"'{name}' is not implemented, by design: .*no formulation"):
        load_config(REPO / "configs" / "cpu_tiny.yaml", [f"algorithm.estimator={name}", "algorithm.estimator_params={}"])
    with pytest.raises(ValueError, match="is not implemented, by design"):
        load_config(REPO / "configs" / "cpu_tiny.yaml", [f"algorithm.loss={name}", "algorithm.loss_params={}"])
    assert name in algos.ESTIMATORS.refused() and name not in algos.list_estimators()


@pytest.mark.parametrize("est, params, named", [
    ("eapo_entropic", "{kappa: -1}", "eapo_entropic.kappa must be >= 0"),
    ("eapo_entropic", "{kappa: .nan}", "kappa must be a finite number"),
    ("eapo_entropic", "{kappa: .inf}", "kappa must be a finite number"),
    ("eapo_entropic", "{kappa: 'x'}", "kappa must be a finite number"),
    ("eapo_entropic", "{decay_steps: -3}", "eapo_entropic.decay_steps must be >= 0"),
    ("eapo_entropic", "{decay_steps: 2.5}", "decay_steps must be an integer"),
    ("pepo", "{window: 100}", "pepo.window must be an odd integer in"),
    ("pepo", "{window: 0}", "pepo.window must be an odd integer in \\[1, 1048577\\]"),
    ("pepo", "{window: 1000000001}", "pepo.window must be an odd integer in \\[1, 1048577\\]"),
    ("pepo", "{temperature: 0}", "pepo.temperature must be > 0"),
    ("pepo", "{temperature: -1}", "pepo.temperature must be > 0"),
    ("pepo", "{temperature: .nan}", "temperature must be a finite number"),
])
def test_hostile_parameters_are_named(est, params, named):
    with pytest.raises(ValueError, match=named):
        load_config(REPO / "configs" / "cpu_tiny.yaml", [f"algorithm.estimator={est}", f"algorithm.estimator_params={params}"])


# ------------------------------------------------------------------------- LESS
# Hand-built groups for QWE-CXZ/LESS recipe/less/revise_advantage.py (``revise_adv``, with
# ``extract_low_entropy_traces``, ``find_max_subset_multisets`` and ``get_subtrace_idx``).
# Rows 0, 1 are correct and 2, 3 wrong (n_right = n_wrong = 2); L = 12 tokens each, low
# entropy (0.1) on the segments, 1.0 elsewhere, so tau = 1.0 (the 11th smallest) and every
# token starts at weight 1/2. GRPO's A = +-0.866 (rewards 1, 1, 0, 0).
L = 12


def _row(ids_low: list[int], at: int, filler: int) -> tuple[list[int], list[float]]:
    ids = [filler * 100 + t for t in range(L)]
    h = [1.0] * L
    for k, tok in enumerate(ids_low):
        ids[at + k], h[at + k] = tok, 0.1
    return ids, h


def _group(rows):
    ids = torch.tensor([r[0] for r in rows])
    h = torch.tensor([r[1] for r in rows])
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    return algos.AdvantageInputs(rewards=rewards, response_mask=torch.ones(4, L, dtype=torch.bool), entropy=h,
                                 group_index=torch.zeros(4, dtype=torch.long), correct=rewards > 0.5, response_ids=ids)


def _weights(inputs):
    out = algos.run_estimator("less", inputs)
    A = grpo_sequence_advantage(inputs).unsqueeze(-1)
    return (out.advantages / A), out.metrics


def _expect(zero=(), one=()):
    w = torch.full((4, L), 0.5)
    for r, pos in zero:
        w[r, pos] = 0.0
    for r, pos in one:
        w[r, pos] = 1.0
    return w


def test_less_a_segment_shared_across_outcomes_is_zeroed_in_both():
    seg = [1, 2, 3, 4, 5, 6, 7]
    w, m = _weights(_group([_row(seg, 0, 1), _row([], 0, 2), _row(seg, 3, 3), _row([], 0, 4)]))
    torch.testing.assert_close(w, _expect(zero=[(0, slice(0, 7)), (2, slice(3, 10))]))
    assert m["less/clusters"] == 1 and m["less/mixed_clusters"] == 1 and m["less/zeroed_frac"] == 14 / 48


def test_less_a_segment_shared_within_one_outcome_is_raised_to_its_share():
    seg = [1, 2, 3, 4, 5]
    w, m = _weights(_group([_row(seg, 2, 1), _row(seg, 6, 2), _row([], 0, 3), _row([], 0, 4)]))
    torch.testing.assert_close(w, _expect(one=[(0, slice(2, 7)), (1, slice(6, 11))]))  # max(1/2, 2 of 2)
    assert m["less/mixed_clusters"] == 0


def test_less_nested_segments_rekey_the_cluster_and_apply_in_order():
    """Row 0's (1..7) lies in row 2's (0..8): a cluster keyed (1..7). Row 3's (2..6) lies in
    row 0's segment and in the key: the cluster is re-keyed (2..6), every member's
    positions narrowed to it, and it is mixed: zeroed there in rows 0, 2 and 3."""
    w, m = _weights(_group([_row([1, 2, 3, 4, 5, 6, 7], 0, 1), _row([], 0, 2),
                            _row([0, 1, 2, 3, 4, 5, 6, 7, 8], 1, 3), _row([2, 3, 4, 5, 6], 4, 4)]))
    torch.testing.assert_close(w, _expect(zero=[(0, slice(1, 6)), (2, slice(3, 8)), (3, slice(4, 9))]))
    assert m["less/clusters"] == 1 and m["less/mixed_clusters"] == 1


def test_less_overlapping_clusters_apply_in_the_references_order():
    """Row 1's (2..6) lies in row 0's (1..7): a correct-only cluster raises it to 1 in both.
    Row 2's (3..7) also lies in row 0's segment: a second, mixed cluster, applied after the
    first, zeroes (3..7) in rows 0 and 2 -- overwriting part of the first's raise in row 0."""
    w, m = _weights(_group([_row([1, 2, 3, 4, 5, 6, 7], 0, 1), _row([2, 3, 4, 5, 6], 5, 2),
                            _row([3, 4, 5, 6, 7], 2, 3), _row([], 0, 4)]))
    want = _expect(one=[(0, slice(1, 2)), (1, slice(5, 10))], zero=[(0, slice(2, 7)), (2, slice(2, 7))])
    torch.testing.assert_close(w, want)
    assert m["less/clusters"] == 2 and m["less/mixed_clusters"] == 1


def test_less_without_shared_segments_keeps_the_base_weights_and_zero_advantages_alone():
    g = torch.Generator().manual_seed(3)
    B, T = 8, 20
    inputs = algos.AdvantageInputs(
        rewards=torch.tensor([1.0, 0, 1, 0, 1, 1, 1, 1]), response_mask=torch.arange(T)[None] < torch.tensor(
            [20, 17, 9, 20, 5, 12, 20, 3])[:, None], entropy=torch.rand(B, T, generator=g),
        group_index=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), correct=torch.tensor([1, 0, 1, 0, 1, 1, 1, 1]).bool(),
        response_ids=torch.randint(0, 10**6, (B, T), generator=g))  # random ids: nothing shared
    out = algos.run_estimator("less", inputs)
    A = grpo_sequence_advantage(inputs)
    assert torch.equal(out.advantages[4:], torch.zeros(4, T))  # an all-correct group: A = 0, untouched
    for i in range(4):
        n = int(inputs.response_mask[i].sum())
        h = inputs.entropy[i, :n].tolist()
        tau = sorted(h)[min(round(0.8 * n), n - 1)]
        want = [float(A[i]) * (0.5 if x <= tau else 1.0) for x in h]  # 2 right, 2 wrong in group 0
        torch.testing.assert_close(out.advantages[i, :n], torch.tensor(want))
        assert float(out.advantages[i, n:].abs().sum()) == 0


def _random_less_batch(seed: int, groups: int, G: int, T: int, vocab: int, levels: int, hole: bool):
    """Random groups where segments recur: a small vocabulary (shared, nested and overlapping
    segments across and within outcomes), entropies from ``levels`` values (ties at the threshold,
    runs of low entropy), some rows a shared motif pasted in, a mask with a hole in some rows (the
    reference counts only the leading run), an all-correct and an all-wrong group among them."""
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    ids = torch.randint(0, vocab, (B, T), generator=g)
    motif = torch.randint(0, vocab, (T // 2,), generator=g)
    for b in range(B):
        if torch.rand((), generator=g) < 0.5:
            at, n = int(torch.randint(0, T // 2, (), generator=g)), int(torch.randint(3, T // 2, (), generator=g))
            ids[b, at:at + n] = motif[:n]
    h = torch.randint(0, levels, (B, T), generator=g).float() / levels
    lens = torch.randint(0, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]
    if hole:
        mask[::3, T // 3] = False
    rewards = (torch.rand(B, generator=g) > 0.5).float()
    rewards[:G], rewards[G:2 * G] = 1.0, 0.0
    return algos.AdvantageInputs(rewards=rewards, response_mask=mask, entropy=h,
                                 group_index=torch.arange(B) // G, correct=rewards > 0.5, response_ids=ids)


@pytest.mark.parametrize("seed, vocab, levels, min_len, hole", [
    (0, 3, 4, 2, False), (1, 4, 5, 5, True), (2, 2, 3, 1, True), (3, 5, 10, 3, False), (4, 3, 2, 4, True),
    (5, 2, 8, 2, False)])
def test_less_tensor_matcher_equals_the_full_scan_on_random_groups(seed, vocab, levels, min_len, hole):
    """Issue 61: the hosts found by hashing the batch's token windows on tensors, and the cluster
    keys looked up through a k-token-window index; advantages and metrics equal the full scan's
    exactly (tests/algos/less_reference.py, the module before the change, the reference's order
    token for token)."""
    from .less_reference import less_reference

    inputs = _random_less_batch(seed, groups=4, G=8, T=48, vocab=vocab, levels=levels, hole=hole)
    got, want = algos.run_estimator("less", inputs, min_len=min_len), less_reference(inputs, min_len=min_len)
    assert torch.equal(got.advantages, want.advantages)
    assert got.metrics == want.metrics and want.metrics["less/clusters"] > 0


def _hosts_by_scan(tokens, offsets, lengths, members, groups):
    """The reference's host search: for each segment, the first of its group, another member's, that
    holds it as a contiguous run (as Python lists)."""
    segs = [tokens[o:o + n].tolist() for o, n in zip(offsets.tolist(), lengths.tolist())]
    out = []
    for s, seg in enumerate(segs):
        out.append(next((o for o, other in enumerate(segs) if members[o] != members[s] and groups[o] == groups[s]
                         and any(other[i:i + len(seg)] == seg for i in range(len(other) - len(seg) + 1))), -1))
    return out


@pytest.mark.parametrize("moduli", [None, (2, 3), (5, 7)])
def test_less_host_search_on_tensors_equals_the_scan_and_settles_no_collision_wrongly(monkeypatch, moduli):
    """first_hosts against the scan on random segments (a 3-token vocabulary: nested, repeated and
    shared runs; four groups; the same response holding several). With tiny moduli nearly every
    window collides: no wrong host is ever returned, only UNSETTLED (which the estimator searches in
    full) where a colliding candidate failed the token check, and the estimator's result stays the
    full scan's."""
    from hapo_openrlhf.algos import segment_match

    if moduli is not None:
        monkeypatch.setattr(segment_match, "MODULI", moduli)
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 9, (60,), generator=g)
    tokens = torch.randint(0, 3, (int(lengths.sum()),), generator=g)
    offsets = torch.cumsum(lengths, 0) - lengths
    members = torch.randint(0, 6, (60,), generator=g)
    groups = torch.sort(torch.randint(0, 4, (60,), generator=g)).values
    got = segment_match.first_hosts(tokens, offsets, lengths, members, groups).tolist()
    want = _hosts_by_scan(tokens, offsets, lengths, members.tolist(), groups.tolist())
    unsettled = [s for s, h in enumerate(got) if h == segment_match.UNSETTLED]
    assert [h for s, h in enumerate(got) if s not in unsettled] == [h for s, h in enumerate(want) if s not in unsettled]
    if moduli is None:
        assert not unsettled and sum(h >= 0 for h in want) > 20
    else:
        assert unsettled
        from .less_reference import less_reference
        inputs = _random_less_batch(1, groups=4, G=8, T=48, vocab=4, levels=5, hole=True)
        got_adv = algos.run_estimator("less", inputs, min_len=5).advantages
        assert torch.equal(got_adv, less_reference(inputs, min_len=5).advantages)


def test_less_needs_token_ids_and_a_positive_segment_length():
    inputs = _batch(0)
    with pytest.raises(ValueError, match="needs the responses' token ids"):
        algos.run_estimator("less", inputs)
    with pytest.raises(ValueError, match="less.min_len must be an integer >= 1"):
        load_config(REPO / "configs" / "cpu_tiny.yaml", ["algorithm.estimator=less", "algorithm.estimator_params={min_len: 0}"])
