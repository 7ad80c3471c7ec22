"""The full-size dry run (megatron/dryrun.py): every shipped ``backend: megatron`` config starts
every rank role at its real size on the meta device under torch's fake process group, through
the Megatron actor's own start-up (megatron/setup.py). A config added to configs/ later is
covered without editing this file."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hapo_openrlhf.config import load_config

REPO = Path(__file__).resolve().parents[2]
MEGATRON_CONFIGS = sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml")
                          if load_config(p).backend == "megatron")
MODEL_CONFIGS = sorted((REPO / "hapo_openrlhf/megatron/model_configs").glob("*.json"))
GB = 1024 ** 3
CP64K = "configs/deepscaler_1p5b_64k_hapo_megatron_cp.yaml"


def _dry_run(config, *args):
    from tests.conftest import run_python  # the module's CLI, forked from the test process's server

    p = run_python(["-m", "hapo_openrlhf.megatron.dryrun", "--config", config, "--json", *args])
    return p, (json.loads(p.stdout) if p.stdout.strip().startswith("{") else None)


# every shipped config's dry run through the module's CLI (its main), in one fresh interpreter for the
# session -- each rank already joins and leaves the fake world in turn inside one process; the
# module run as `python -m`, one config a process, is test_a_layout_that_cannot_start_or_fit_...'s: issue 57
_SHIPPED = textwrap.dedent("""
    import contextlib, io, json, sys
    from hapo_openrlhf.megatron.dryrun import main
    out = {}
    for name in sys.argv[2:]:  # the module's CLI, `python -m hapo_openrlhf.megatron.dryrun --config NAME --json`
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["--config", name, "--json"])
        out[name] = {"returncode": rc, "run": json.loads(buf.getvalue())}
    open(sys.argv[1], "w").write(json.dumps(out))
""")


@pytest.fixture(scope="session")
def shipped_runs(tmp_path_factory, request):
    """{config: (the module CLI's exit code, its JSON)} for the shipped Megatron configs this session's tests ask for
    (a deselected case's config is not run), built once per test run, shared by the xdist workers."""
    from tests.conftest import shared_once

    wanted = sorted({"configs/qwen3_30b_a3b_hapo_megatron.yaml", CP64K} | {
        item.callspec.params["config"] for item in request.session.items
        if item.originalname == "test_every_shipped_megatron_config_starts_every_rank_role_at_full_size"})
    with shared_once(tmp_path_factory, "megatron_dry_runs") as (d, done):
        if not done:
            p = subprocess.run([sys.executable, "-c", _SHIPPED, str(d / "runs.json"), *wanted],
                               cwd=REPO, capture_output=True, text=True, timeout=900)
            assert p.returncode == 0 and (d / "runs.json").exists(), p.stderr[-3000:]
    return {k: (v["returncode"], v["run"]) for k, v in json.loads((d / "runs.json").read_text()).items()}


def test_the_glob_finds_the_shipped_megatron_configs():
    assert {"configs/qwen3_30b_a3b_hapo_megatron.yaml", "configs/deepscaler_1p5b_24k_hapo_megatron.yaml",
            "configs/qwen25_math_7b_hapo_megatron.yaml", "configs/qwen3_8b_base_hapo_megatron.yaml"} <= set(MEGATRON_CONFIGS)


@pytest.mark.parametrize("config", MEGATRON_CONFIGS)
def test_every_shipped_megatron_config_starts_every_rank_role_at_full_size(config, shipped_runs):
    returncode, run = shipped_runs[config]
    assert run["error"] is None, run["error"]
    cfg = load_config(REPO / config)
    m, o = cfg.megatron, cfg.openrlhf
    assert run["world"] == o.actor_num_nodes * o.actor_gpus_per_node
    # every role: first / last pipeline stage, TP rank 0 and last, EP rank 0 and last
    roles = {(r["pp_rank"], r["tp_rank"], r["ep_rank"]) for r in run["ranks"]}
    assert {(s, t, e) for s in {0, m.pipeline_parallel - 1} for t in {0, m.tensor_parallel - 1}
            for e in {0, m.expert_parallel - 1}} <= roles
    for r in run["ranks"]:
        assert r["tensors_checked"] > 0 and r["params"] > 0 and r["total_gb"] > 0
    assert run["fits"] and returncode == 0, (run["peak_gb"], run["gpu_gb"])


def test_the_30b_moe_layout_by_hand(shipped_runs):
    """Qwen3-30B-A3B at EP=16 x DP=16: each rank's buffers and optimizer shards as computed by
    hand from the config. Dense part: embedding and head 2 x 151936 x 2048, per layer q/o
    2 x 2048 x 4096, k/v 2 x 2048 x 512, two norms, QK-norm 2 x 128, router 128 x 2048, the
    final norm: 1,541,093,376. Experts: 48 layers x 8 local experts x 3 x 2048 x 768."""
    _, run = shipped_runs["configs/qwen3_30b_a3b_hapo_megatron.yaml"]
    assert run["error"] is None, run["error"]
    dense = 2 * 151936 * 2048 + 48 * (2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 2048 + 2 * 128 + 128 * 2048) + 2048
    assert dense == 1_541_093_376
    experts = 48 * 8 * 3 * 2048 * 768
    for r in run["ranks"]:
        assert r["params"] == dense + experts
        assert r["weights_gb"] == pytest.approx(2 * (dense + experts) / GB, rel=1e-3)  # bf16
        assert r["grads_gb"] == pytest.approx(4 * (dense + experts) / GB, rel=1e-3)  # fp32 buffers
        # fp32 masters + two moments: the dense part sharded over DP 16, the experts over DP / EP = 1
        assert r["optimizer_gb"] == pytest.approx(12 * (dense / 16 + experts) / GB, rel=1e-3)
    # rank 0 reads its 8 experts' 3 tensors in each of 48 layers, each layer's q, k, v, o, two norms,
    # QK-norm's two and the router, the embedding, final norm and head: every one by name and shape
    assert run["ranks"][0]["tensors_checked"] == 48 * 8 * 3 + 48 * 9 + 3


def test_the_64k_context_parallel_layout_by_hand(shipped_runs):
    """DeepScaleR-1.5B at 64k responses, TP 2 x CP 2 x DP 2 (issue 58): each rank's parameters from the
    config by hand -- the vocabulary 151,936 padded to 152,064 (a multiple of 128 x TP), embedding and
    untied head split over TP, per layer q/k/v (with biases; 2 KV heads of 128) and o, the SwiGLU MLP
    (8,960) split over TP, the two norms whole, the final norm -- the distributed optimizer sharded
    over DP x CP = 4 (CP ranks hold the same parameters), and the activations at the budget's 36,864
    tokens per CP rank: TE's ring adds two buffers of the rank's K/V, and the whole 73,728 tokens on
    one rank (CP 1) would need about twice the memory."""
    from hapo_openrlhf.megatron.dryrun import model_config
    from hapo_openrlhf.megatron.memory import activation_bytes

    _, run = shipped_runs[CP64K]
    assert run["error"] is None, run["error"]
    assert run["layout"] == {"tp": 2, "pp": 1, "ep": 1, "cp": 2, "dp": 2}
    assert run["tokens_per_micro_batch"] == 36864
    V, H, L, F = 152064, 1536, 28, 8960
    per_layer = (H * H + H) + 2 * (256 * H + 256) + H * H
    params = V * H // 2 * 2 + L * (per_layer // 2 + 3 * H * F // 2 + 2 * H) + H
    assert params == 888_784_384
    assert {r["tp_rank"] for r in run["ranks"]} == {0, 1} and all("CP rank 0/2" in r["role"] for r in run["ranks"])
    for r in run["ranks"]:
        assert r["params"] == params and r["tensors_checked"] == L * 12 + 3
        assert r["weights_gb"] == pytest.approx(2 * params / GB, rel=1e-3)
        assert r["optimizer_gb"] == pytest.approx(12 * params / 4 / GB, rel=1e-3)
    hf, _ = model_config("agentica-org/DeepScaleR-1.5B-Preview")
    kw = dict(layers=L, tp=2, sequence_parallel=True, padded_vocab=V, head_chunk=1024)
    cp2 = activation_bytes(hf, tokens=36864, cp=2, cp_comm_type="p2p", **kw)
    assert run["ranks"][0]["activations_gb"] == pytest.approx(cp2 / GB, rel=1e-6)
    assert cp2 - activation_bytes(hf, tokens=36864, **kw) == 2 * (2 * 36864 * 2 * 2 * 128 // 2)  # the ring's K/V
    whole = activation_bytes(hf, tokens=2 * 36864, **kw)  # the same sequences on one rank
    assert 0.5 < cp2 / whole < 0.56, cp2 / whole  # 0.554: the head's logits chunk and the ring's buffers stay


def test_a_layout_that_cannot_start_or_fit_fails_with_the_rank_and_reason():
    """Through the module's CLI: TP 4 on the 1.5B model's 2 KV heads stops at rank 0 with the
    converter's reason; the 30B layout on 40 GB GPUs does not fit; exit 1 either way."""
    p, run = _dry_run("configs/deepscaler_1p5b_24k_hapo_megatron.yaml", "--set", "megatron.tensor_parallel=4")
    assert p.returncode == 1 and run["error"].startswith("rank 0 of 4: ValueError")
    assert "num_key_value_heads" in run["error"] and run["ranks"] == []
    p, run = _dry_run("configs/qwen3_30b_a3b_hapo_megatron.yaml", "--gpu-gb", "40")
    assert p.returncode == 1 and run["error"] is None and not run["fits"] and run["peak_gb"] > 37


def test_pp_with_ep_is_refused_at_load_as_megatron_core_would_crash_at_start(tmp_path):
    """The layout the 30B config shipped with (PP=2 x EP=8) asserted in megatron-core's
    initialize_model_parallel on every rank: reproduced at PP=2 x EP=2 on 4 fake ranks through
    the actor's own set-up, and now refused by name when the config loads. PP=2 x CP=2 asserts the
    same way, a dense model included (megatron-core's expert grid folds CP into data parallelism):
    refused by name too (found wiring CP through the pipeline, issue 58)."""
    script = textwrap.dedent("""
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from hapo_openrlhf.megatron.meta_platform import meta_platform
        from hapo_openrlhf.megatron.setup import init_parallel_state
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        with meta_platform():
            try:
                init_parallel_state(1, 2, 2)
                print("started")
            except AssertionError as e:
                print("assert:", e)
            from megatron.core import parallel_state as ps
            ps.destroy_model_parallel()
            r = init_parallel_state(1, 1, 2)  # the layout the loader points to instead
            print("pp1", r.dp_size, r.ep_rank, r.expert_dp_size)
            ps.destroy_model_parallel()
            try:
                init_parallel_state(1, 2, 1, 2)  # PP 2 x CP 2, no experts
                print("cp started")
            except AssertionError as e:
                print("cp assert:", e)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "assert: When not using pp-last rank ordering" in p.stdout, p.stderr[-2000:]
    assert "pp1 4 0 2" in p.stdout
    assert "cp assert: When not using pp-last rank ordering" in p.stdout, p.stdout
    with pytest.raises(ValueError, match="context_parallel 2 with pipeline_parallel 2 cannot start"):
        load_config(REPO / "configs/deepscaler_1p5b_64k_hapo_megatron_cp.yaml",
                    ["megatron.pipeline_parallel=2", "megatron.tensor_parallel=1"])
    with pytest.raises(ValueError, match="expert_parallel 2 with pipeline_parallel 2 cannot start"):
        load_config(REPO / "configs/qwen3_30b_a3b_hapo_megatron.yaml",
                    ["openrlhf.actor_num_nodes=1", "openrlhf.actor_gpus_per_node=4", "megatron.pipeline_parallel=2",
                     "megatron.expert_parallel=2"])


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: p.stem)
def test_the_shipped_model_configs_match_transformers_own_models(path):
    """Each shipped config.json builds in transformers (the oracle of the checkpoint's names and
    shapes, on the meta device), and its state dict is exactly what the converter reads
    (``convert.hf_shapes``, experts in the checkpoint's per-expert names)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hapo_openrlhf.megatron.convert import hf_shapes
    from hapo_openrlhf.megatron.moe import to_checkpoint_names

    hf_config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    theirs = {k: tuple(v.shape) for k, v in to_checkpoint_names(model.state_dict(), hf_config).items()}
    assert theirs == hf_shapes(hf_config)


def test_doctor_runs_the_dry_run_for_a_megatron_config(tmp_path):
    from tests.conftest import run_cli

    p = run_cli(["doctor", "--config", "configs/qwen3_30b_a3b_hapo_megatron.yaml", "--static", "--json",
                 "--output-dir", str(tmp_path / "o"), "--gpu-gb", "80"])
    checks = {c["name"]: c for c in json.loads(p.stdout)["checks"]}
    assert checks["dry run memory"]["status"] == "ok" and "peak 48.5 GB" in checks["dry run memory"]["message"]
    assert "EP rank 15/16" in checks["dry run rank 15"]["message"]
