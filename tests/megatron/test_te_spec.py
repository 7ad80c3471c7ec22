"""megatron-core's Transformer Engine layer spec (``megatron.layer_spec: te``), under the TE
2.20.2 stand-in (te_stub/; its fidelity: test_te_standin.py): TE's fused norms
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``; ``IdentityOp`` input and
pre-MLP norms) through the converter, the streamed weight sync and the checkpoints, and
sequence parallelism, which the spec makes reachable.

One job of ranks forked from the TE fork server (``spawn_te``: megatron-core must find the stand-in at import)
runs every check under three parallel layouts in turn, TP=2, PP=2 and TP=1 x DP=2, and
writes what it found; the tests below read it. Shown:

* the model built from the TE spec has exactly the converter's tensor names and shapes, for
  Qwen2 (QKV bias), Qwen3 (QK-norm) and Llama (llama3 RoPE), tied and untied, and the same
  tensor-parallel tags as the local spec;
* HF -> Megatron (TE spec) -> HF is exact through the model (streamed weights == the
  Hugging Face model they were loaded from) at TP 1 / 2 and PP 1 / 2; the pure converter at
  TP x PP in {1, 2}^2 (including TP=2 x PP=2) in ``test_te_names_round_trip_exactly``;
* log-probs, entropy and every gradient equal Hugging Face's at TP=2 with sequence
  parallelism on (and off), packed THD micro-batches through TE's attention;
* two optimizer steps at TP=2 with sequence parallelism equal the Hugging Face + AdamW
  reference, on TE's FusedAdam as megatron-core picks it;
* a run with the TE spec and sequence parallelism resumes bitwise (2 steps + checkpoint + a
  model and optimizer built afresh from it + 2 steps == 4 steps), and a checkpoint written
  with the local spec loads into the TE spec exactly (the same sharded names).
"""

from __future__ import annotations

import traceback

import pytest
import torch

from ._dist import spawn_te
from .test_convert import FAMILIES, tiny_config

TARGET = "tests.megatron.test_te_spec:_job"
# (family, tied, sequence parallelism) at TP=2
TP2_CASES = [("qwen2", True, True), ("qwen2", False, False), ("qwen3", False, True), ("llama", True, True)]


def _record(results: dict, key: str, check) -> None:
    """Run ``check()`` (comparisons only, no collective); store None or the failure."""
    try:
        check()
        results[key] = None
    except Exception:  # noqa: BLE001 - reported by the test that reads ``key``
        results[key] = traceback.format_exc(limit=4)


def _tags(model, rename=None) -> dict:
    tags = ("tensor_model_parallel", "partition_dim")
    out = {}
    for n, p in model.named_parameters():
        n = rename(n) if rename else n
        out[n] = tuple(getattr(p, t, None) for t in tags) if getattr(p, "tensor_model_parallel", False) else None
    return out


def _names_and_load(results, key, model, hf, **layout):
    from hapo_openrlhf.megatron.convert import hf_to_megatron

    want = hf_to_megatron(hf.state_dict(), hf.config, spec="te", **layout)
    have = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")}

    def names():
        assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in have), sorted(have)
        assert have == {k: tuple(v.shape) for k, v in want.items()}, (sorted(set(have) ^ set(want)))

    _record(results, f"{key}/names", names)
    missing, unexpected = model.load_state_dict(want, strict=False)

    def strict():
        assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)

    _record(results, f"{key}/strict_load", strict)


def _stream_round_trip(results, key, model, hf, rank):
    from hapo_openrlhf.megatron.convert import gather_hf_state_dict

    sd = gather_hf_state_dict(model, hf.config)  # collective: the vLLM sync's and the final save's path
    if rank == 0:
        ref = hf.state_dict()

        def exact():
            assert set(sd) == set(ref) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())
            for n, t in sd.items():
                assert torch.equal(t, ref[n]), n

        _record(results, f"{key}/stream_exact", exact)


def _tp2(rank, results, tmp):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.convert import megatron_to_hf, to_spec
    from hapo_openrlhf.megatron.model import build_gpt_model
    from hapo_openrlhf.megatron.schedule import allreduce_tp_replicated_grads, logprobs_and_entropy

    from .test_convert import tiny_model
    from .test_tensor_parallel import T, _batch, _both_real, _hf_reference

    tp_group = ps.get_tensor_model_parallel_group()
    for family, tied, sp in TP2_CASES:
        key = f"tp2/{family}/{'tied' if tied else 'untied'}/{'sp' if sp else 'nosp'}"
        hf = tiny_model(family, tied, layers=2)
        model = build_gpt_model(hf.config, tp=2, spec="te", sequence_parallel=sp, perform_initialization=False)
        _names_and_load(results, key, model, hf, tp=2, tp_rank=rank)
        local = build_gpt_model(hf.config, tp=2, perform_initialization=False)
        te_name = lambda n: next(iter(to_spec({n: None}, "te")))  # noqa: E731
        _record(results, f"{key}/tp_tags", lambda: _assert_equal(_tags(model), _tags(local, te_name)))
        ids, am, w_lp, w_en = _batch()
        am[0, -2:] = 0  # right padding too
        lp, en = logprobs_and_entropy(model, ids, am, vocab_size=259, temperature=T, chunk_size=5,
                                      tp_group=tp_group, tp_rank=rank)  # packed THD; padded to TP with SP
        m = _both_real(am).float()
        ((lp * w_lp * m).sum() + (en * w_en * m).sum()).backward()
        allreduce_tp_replicated_grads(model)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        everyone = [None] * 2
        dist.all_gather_object(everyone, grads)
        _stream_round_trip(results, key, model, hf, rank)
        if rank == 0:
            ref_lp, ref_en, ref_grads = _hf_reference(hf, ids, am, w_lp.double(), w_en.double())
            valid = _both_real(am)

            def values():
                torch.testing.assert_close(lp.detach().double()[valid], ref_lp[valid], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(en.detach().double()[valid], ref_en[valid], rtol=1e-4, atol=1e-4)

            def gradients():
                merged = megatron_to_hf({(0, r): everyone[r] for r in range(2)}, hf.config, tp=2, pp=1)
                assert set(merged) == set(ref_grads) - ({"lm_head.weight"} if tied else set())
                for n, g in merged.items():
                    torch.testing.assert_close(g.double(), ref_grads[n], rtol=1e-3, atol=1e-5, msg=n)

            _record(results, f"{key}/logprobs_entropy", values)
            _record(results, f"{key}/gradients", gradients)

    # the local spec's checkpoint names are the TE spec's (megatron-core's sharded_state_dict_keys_map):
    # a checkpoint written by a local-spec model loads into a TE-spec model exactly (hapo's checkpoint code)
    from hapo_openrlhf.megatron import checkpoint

    from ._dist import load_hf_into

    hf = tiny_model("qwen3", False, layers=2)
    local = build_gpt_model(hf.config, tp=2, perform_initialization=False)
    load_hf_into(local, hf, tp=2, tp_rank=rank)
    path = checkpoint.save(tmp / "local_spec_ckpt", 1, local, None, {"step": 1})
    te = build_gpt_model(hf.config, tp=2, spec="te", sequence_parallel=True, perform_initialization=False)
    try:
        state, err = checkpoint.load(path, te), None
    except Exception:  # noqa: BLE001
        state, err = None, traceback.format_exc(limit=4)
    want = to_spec({k: v for k, v in local.state_dict().items() if not k.endswith("_extra_state")}, "te")

    def same():
        assert err is None, err
        assert state == {"step": 1}
        got = {k: v for k, v in te.state_dict().items() if not k.endswith("_extra_state")}
        assert set(got) == set(want)
        for k, v in got.items():
            assert torch.equal(v, want[k]), k

    _record(results, f"tp2/local_checkpoint_into_te/rank{rank}", same)


def _assert_equal(a, b):
    assert a == b, {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k) != b.get(k)}


def _pp2_and_tp1(rank, results):
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.model import build_gpt_model
    from hapo_openrlhf.megatron.schedule import forward_backward

    from ._dist import replace_model_parallel
    from .test_convert import hf_logprobs_entropy, tiny_model
    from .test_tensor_parallel import T, _batch, _both_real

    for tp, pp in ((1, 2), (1, 1)):
        replace_model_parallel(tp=tp, pp=pp)
        stage = ps.get_pipeline_model_parallel_rank()
        for family in FAMILIES:
            tied = family != "qwen3"
            key = f"tp{tp}pp{pp}/{family}"
            hf = tiny_model(family, tied, layers=2)
            model = build_gpt_model(hf.config, tp=tp, pp=pp, pp_rank=stage, spec="te", perform_initialization=False)
            _names_and_load(results, f"{key}/stage{stage}", model, hf, tp=tp, tp_rank=0, pp=pp, pp_rank=stage)
            _stream_round_trip(results, key, model, hf, rank)
            ids, am, _, _ = _batch()
            mbs = [{"input_ids": ids[i:i + 1], "attention_mask": am[i:i + 1]} for i in range(len(ids))]
            with torch.no_grad():
                out = forward_backward(model, mbs, None, vocab_size=259, temperature=T, forward_only=True)
            if out and (pp == 2 or rank == 0):  # the last stage; at PP=1 one replica reports
                lp = torch.cat([o[0] for o in out]).double()
                en = torch.cat([o[1] for o in out]).double()
                ref_lp, ref_en = hf_logprobs_entropy(hf, ids, am, T)
                valid = _both_real(am)

                def values():
                    torch.testing.assert_close(lp[valid], ref_lp.detach()[valid], rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(en[valid], ref_en.detach()[valid], rtol=1e-4, atol=1e-4)

                _record(results, f"{key}/logprobs_entropy", values)


def _job(rank, out_dir):
    from pathlib import Path

    import transformer_engine

    from ._dist import init_megatron, replace_model_parallel
    from .test_ddp import _resume_worker, train_two_steps

    out = Path(out_dir)
    results = {"te_version": transformer_engine.__version__}
    init_megatron(tp=2)
    from megatron.core.extensions.transformer_engine import HAVE_TE
    import megatron.core.optimizer as mopt

    results["have_te"] = HAVE_TE
    results["adam"] = f"{mopt.Adam.__module__}.{mopt.Adam.__name__}"
    _tp2(rank, results, out)
    # two steps at TP=2 with sequence parallelism == Hugging Face + AdamW (test_ddp's reference)
    replace_model_parallel(tp=2)
    train_two_steps(rank, 2, 1, True, "fp32", str(out / "two_steps.pt"), spec="te", sp=True)
    # bitwise resume, TE spec + sequence parallelism, the distributed optimizer on TE's FusedAdam
    for phase, name in (("full", "full"), ("first", "first"), ("resume", "resumed")):
        replace_model_parallel(tp=2)
        _resume_worker(rank, 2, "dp_reshardable", str(out / "ckpt"), phase, str(out / name), spec="te", sp=True,
                       init=False)
    _pp2_and_tp1(rank, results)
    # `hapo doctor --gpu-smoke`'s TE-spec check (there: CUDA and the real TE), here at TP=1 x DP=2
    from hapo_openrlhf.gpu_smoke import te_spec_check

    results[f"gpu_smoke.{rank}"] = te_spec_check("cpu")  # rank 0 receives the streamed weights
    torch.save(results, out / f"results.{rank}")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("te_spec")
    spawn_te(TARGET, 2, str(out))
    results = {}
    for r in range(2):
        results.update({k: v for k, v in torch.load(out / f"results.{r}").items()})
    return out, results


def _check(results, prefix):
    keys = [k for k in results if k.startswith(prefix)]
    assert keys, f"no check under {prefix!r}: {sorted(results)}"
    failed = {k: results[k] for k in keys if results[k] is not None}
    assert not failed, "\n".join(f"{k}:\n{v}" for k, v in failed.items())
    return keys


def test_the_job_ran_on_the_te_stand_in(job):
    _, res = job
    assert res["have_te"] is True and res["te_version"] == "2.20.2"
    assert res["adam"] == "tests.megatron.te_standin.FusedAdam"  # megatron-core's own pick once TE imports


def test_the_gpu_smokes_te_spec_check_runs_on_the_stand_in(job):
    res = job[1]["gpu_smoke.0"]
    assert res["ok"] and res["loaded_strict"] and res["stream_exact"], res
    assert res["logprob_max_abs_err"] < 1e-4 and res["entropy_max_abs_err"] < 1e-4, res


@pytest.mark.parametrize("family, tied, sp", TP2_CASES)
def test_tp2_te_spec_equals_hugging_face(job, family, tied, sp):
    """Names, strict load, TP tags, streamed round trip, log-probs / entropy and every gradient."""
    key = f"tp2/{family}/{'tied' if tied else 'untied'}/{'sp' if sp else 'nosp'}/"
    keys = _check(job[1], key)
    assert {k.rsplit("/", 1)[1] for k in keys} == {"names", "strict_load", "tp_tags", "stream_exact",
                                                   "logprobs_entropy", "gradients"}


@pytest.mark.parametrize("layout", ["tp1pp2", "tp1pp1"])
def test_te_spec_names_round_trip_and_logprobs_without_tp(job, layout):
    keys = _check(job[1], layout + "/")
    for family in FAMILIES:
        assert {k.rsplit("/", 1)[1] for k in keys if k.startswith(f"{layout}/{family}/")} >= {
            "names", "strict_load", "stream_exact", "logprobs_entropy"}, family


def test_two_steps_at_tp2_with_sequence_parallelism_equal_hf_adamw(job):
    from .test_ddp import _assert_matches_reference, hf_reference

    got = torch.load(job[0] / "two_steps.pt")
    _assert_matches_reference(got, hf_reference(True), True)


def test_te_spec_with_sequence_parallelism_resumes_bitwise(job):
    from .test_te_fused_adam import _assert_bitwise

    _assert_bitwise(job[0], 2)


def test_a_local_spec_checkpoint_loads_into_the_te_spec(job):
    _check(job[1], "tp2/local_checkpoint_into_te/")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_te_names_round_trip_exactly(family, tp, pp):
    """The pure converter: HF -> Megatron (TE names) -> HF is exact; the TE shards are the local
    shards with the two per-layer norms renamed, nothing else."""
    from transformers import AutoModelForCausalLM

    from hapo_openrlhf.megatron.convert import TE_NORM_NAMES, hf_to_megatron, megatron_to_hf, spec_of, to_spec

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config(family, family != "qwen3", layers=4))
    sd = hf.state_dict()
    te = {(s, r): hf_to_megatron(sd, hf.config, tp=tp, tp_rank=r, pp=pp, pp_rank=s, spec="te")
          for s in range(pp) for r in range(tp)}
    for (s, r), shard in te.items():
        local = hf_to_megatron(sd, hf.config, tp=tp, tp_rank=r, pp=pp, pp_rank=s)
        assert spec_of(shard) == "te" and spec_of(local) == "local"
        assert to_spec(local, "te").keys() == shard.keys()
        assert all(torch.equal(to_spec(local, "te")[k], v) for k, v in shard.items())
        assert not any(k.endswith(tuple(TE_NORM_NAMES)) for k in shard)
        assert sum(k.endswith(tuple(TE_NORM_NAMES.values())) for k in shard) == 2 * 4 // pp
    back = megatron_to_hf(te, hf.config, tp=tp, pp=pp)
    want = {k: v for k, v in sd.items() if not (hf.config.tie_word_embeddings and k == "lm_head.weight")}
    assert back.keys() == want.keys()
    assert all(torch.equal(back[k], v) for k, v in want.items())
    with pytest.raises(ValueError, match="layer spec must be one of"):
        hf_to_megatron(sd, hf.config, spec="transformer_engine")
