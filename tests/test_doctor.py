"""`hapo doctor` through the real CLI: the embedded config passes here, a GPU config is
refused naming what is missing, the GPU smoke reports the missing GPU cleanly, and
`hapo submit` runs the static checks."""

import json

import pytest

from hapo_openrlhf.config import load_config
from hapo_openrlhf.cluster.doctor import FAIL, OK, WARN, check_output_dir, check_slurm_lead, check_vllm_memory, run_checks
from tests.conftest import REPO, cli_in_process, run_cli


def test_embedded_config_passes_here(tmp_path):
    p = run_cli(["doctor", "--config", "configs/cpu_tiny.yaml", "--output-dir", str(tmp_path / "o")])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all checks passed" in p.stdout and "[  ok] cuda: not needed" in p.stdout
    # the version matrix, one line per package, whatever the config needs
    import sys
    from importlib.metadata import version

    v = sys.version_info
    for line in (f"matrix python: {v.major}.{v.minor}.{v.micro}", f"matrix torch: {version('torch')}",
                 f"matrix megatron-core: {version('megatron-core')}", "matrix transformer-engine: not installed",
                 "matrix flash-attn: not installed", "matrix vllm: not installed"):
        assert line in p.stdout, (line, p.stdout)


def test_gpu_config_is_refused_naming_cuda_and_ring_flash_attn(tmp_path):
    p = run_cli(["doctor", "--config", "configs/deepscaler_1p5b_24k_hapo.yaml", "--json",
                 "--output-dir", str(tmp_path / "o")])
    assert p.returncode == 1, p.stdout + p.stderr
    res = json.loads(p.stdout)
    failed = {c["name"]: c for c in res["checks"] if c["status"] == FAIL}
    assert not res["ok"] and "cuda" in failed and "no CUDA device" in failed["cuda"]["message"]
    assert "package ring-flash-attn" in failed and "ring_attn_size 2" in failed["package ring-flash-attn"]["message"]
    assert "--no-build-isolation" in failed["package flash-attn"]["fix"]
    lead = next(c for c in res["checks"] if c["name"] == "slurm signal lead")
    assert lead["status"] == OK and "2143 s" in lead["message"]


def test_gpu_smoke_reports_no_gpu():
    p = run_cli(["doctor", "--gpu-smoke", "--json"])
    assert p.returncode == 1
    res = json.loads(p.stdout)
    assert res["cuda"] is False and "no CUDA GPU visible" in res["error"] and "Traceback" not in p.stderr


def test_checks_by_hand(tmp_path):
    cfg = load_config(REPO / "configs/qwen25_math_7b_hapo_megatron.yaml")
    assert check_vllm_memory(cfg).status == OK  # dedicated engine GPUs default to 0.9
    low = load_config(REPO / "configs/qwen25_math_7b_hapo_megatron.yaml", ["openrlhf.vllm_gpu_memory_utilization=0.5"])
    assert check_vllm_memory(low).status == WARN
    short = load_config(REPO / "configs/qwen25_math_7b_hapo.yaml", ["slurm.expected_step_s=900", "slurm.signal_lead_s=600"])
    assert check_slurm_lead(short).status == FAIL and "slurm.signal_lead_s >= 1650" in check_slurm_lead(short).fix
    derived = load_config(REPO / "configs/qwen25_math_7b_hapo.yaml", ["slurm.expected_step_s=900"])
    assert check_slurm_lead(derived).status == OK and "1650 s" in check_slurm_lead(derived).message
    # a 7B model: (3 kept + 1 in flight) checkpoints x 7e9 params x 14 B = 365 GiB
    c = check_output_dir(cfg, str(tmp_path / "run"))[0]
    assert "~7.00B params need ~365" in c.message
    # PRIME keeps its implicit PRM (weights, reference, AdamW moments: 16 B/param more) in every checkpoint
    tiny = load_config(REPO / "configs/cpu_tiny_prime.yaml")
    p = check_output_dir(tiny, str(tmp_path / "prime"))[0]
    assert "(30 B/param, the implicit PRM included)" in p.message
    assert "(14 B/param)" in check_output_dir(load_config(REPO / "configs/cpu_tiny.yaml"), str(tmp_path / "t"))[0].message
    names = [c.name for c in run_checks(cfg, static=True, output_dir=str(tmp_path), dry_run=False)]
    assert "cuda" not in names and "nccl" not in names and "package megatron-core" in names
    assert "dry run memory" not in names  # tests/megatron/test_dryrun.py runs it


@pytest.mark.parametrize("config", ["configs/deepscaler_1p5b_24k_hapo.yaml"])
def test_submit_dry_run_shows_the_lead_and_ray_resources(config):
    p = run_cli(["submit", config, "--nodes", "2", "--dry-run"])
    assert p.returncode == 0, p.stderr
    assert "#SBATCH --signal=B:USR1@2143" in p.stdout  # >= 30 min for 24k-token steps
    assert "--ray-num-gpus 8" in p.stdout and "#SBATCH --cpus-per-task=64" in p.stdout
    assert "hapo doctor (static)" in p.stderr and "ring-flash-attn" in p.stderr  # reported, not blocking a dry run


def test_submit_refuses_a_config_with_blocking_problems(tmp_path):
    p = run_cli(["submit", "configs/deepscaler_1p5b_24k_hapo.yaml", "--output-dir", str(tmp_path)])
    assert p.returncode == 2 and "blocking problems" in p.stderr and "--skip-doctor" in p.stderr
    assert not (tmp_path / "job.sbatch").exists()


def test_an_output_dir_that_is_a_file_and_a_damaged_model_are_reported(tmp_path):
    """The doctor reports each problem in its table (it does not abort on the first): an
    output_dir that is a regular file, a model config.json that is not JSON, a truncated
    safetensors file."""
    f = tmp_path / "not_a_dir"
    f.write_text("x")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{torn")
    p = run_cli(["doctor", "--config", "configs/cpu_tiny.yaml", "--json", "--output-dir", str(f / "run"),
                 "--set", f"model.path={model}"])
    assert p.returncode == 1, p.stdout + p.stderr
    failed = {c["name"]: c["message"] for c in json.loads(p.stdout)["checks"] if c["status"] == FAIL}
    assert f"{f} is a file, not a directory" in failed["output_dir"]
    assert "config.json" in failed["model"] and "not JSON" in failed["model"]
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    p = cli_in_process(["doctor", "--config", "configs/cpu_tiny.yaml", "--json", "--output-dir", str(tmp_path / "o"),
                        "--set", f"model.path={model}"])
    assert p.returncode == 1, p.stdout + p.stderr
    failed = {c["name"]: c["message"] for c in json.loads(p.stdout)["checks"] if c["status"] == FAIL}
    assert "model.safetensors is incomplete or corrupt" in failed["model"]


def test_megatron_refuses_an_unsupported_model_family_by_name(tmp_path):
    """backend: megatron builds Qwen2, Qwen3 and Llama: another family (Mistral), or a
    supported family's variant the GPTModel would compute differently (YaRN RoPE, llama3
    scaling with other frequency factors, sliding windows, biases), is refused by the
    doctor from config.json and at model build, naming the supported ones or the key."""
    from transformers import LlamaConfig, Qwen3Config

    from hapo_openrlhf.megatron.convert import check_model_type
    from hapo_openrlhf.megatron.model import transformer_config

    def doctor(meta, *sets):
        model = tmp_path / "model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(meta))
        # the doctor's table in this process (cli.main, issue 57): the exit codes and the entry point are
        # held by the subprocess cases above
        p = cli_in_process(["doctor", "--config", "configs/qwen25_math_7b_hapo_megatron.yaml", "--json", "--static",
                            "--no-dry-run", "--output-dir", str(tmp_path / "o"), "--set", f"model.path={model}",
                            *[x for kv in sets for x in ("--set", kv)]])
        return {c["name"]: c["message"] for c in json.loads(p.stdout)["checks"] if c["status"] == FAIL}

    failed = doctor({"model_type": "mistral"})
    assert "supports Hugging Face model_type qwen2 (Qwen2 / Qwen2.5), qwen3" in failed["model"]
    assert "llama (Llama 2 / 3.x), qwen3_moe (Qwen3-MoE); got 'mistral'" in failed["model"]
    failed = doctor({"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    assert "RoPE scaling 'dynamic' (supported: none, yarn, or llama3 on llama)" in failed["model"]
    # YaRN is built (megatron-core's YarnRotaryEmbedding, tests/megatron/test_rope_scaling.py), but not without
    # the pretraining context it stretches
    failed = doctor({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert "YaRN RoPE scaling without original_max_position_embeddings" in failed["model"]
    assert "model" not in doctor({"model_type": "qwen3"})
    assert check_model_type("qwen3").qk_norm
    # Qwen3-MoE: the layout the actor cannot serve, each by name from config.json
    moe = {"model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "norm_topk_prob": True}
    failed = doctor(moe)  # this config's TP=2
    assert "a mixture of experts at tensor_parallel 2 needs sequence parallelism" in failed["model"]
    ep4 = ["megatron.tensor_parallel=1", "megatron.pipeline_parallel=1", "megatron.expert_parallel=4"]
    failed = doctor(moe, *ep4)
    assert "cannot lay out this Qwen3-MoE model: num_experts 6 is not divisible by expert parallel size 4" \
        in failed["model"]
    assert "model" not in doctor({**moe, "num_experts": 8}, *ep4)
    failed = doctor({**moe, "num_experts_per_tok": 7}, *ep4)
    assert "num_experts_per_tok 7 must be between 1 and num_experts 6" in failed["model"]
    failed = doctor({"model_type": "qwen3"}, *ep4)
    assert "expert parallel size 4 needs a mixture-of-experts model" in failed["model"]
    failed = doctor({"model_type": "qwen3"}, "megatron.recompute=false", "megatron.moe.routing_replay=r3")
    assert "routing_replay replays a mixture of experts' routes, and this model is dense" in failed["model"]
    assert "model" not in doctor({**moe, "num_experts": 8}, *ep4, "megatron.moe.routing_replay=r3")
    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2)
    with pytest.raises(ValueError, match="high_freq_factor.*only the factor is free"):
        transformer_config(LlamaConfig(**small, max_position_embeddings=16384, rope_parameters={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
            "original_max_position_embeddings": 8192, "rope_theta": 5e5}))
    with pytest.raises(ValueError, match="sliding-window attention layers"):
        transformer_config(Qwen3Config(**small, use_sliding_window=True, sliding_window=8, max_window_layers=1))
    with pytest.raises(ValueError, match="attention_bias: true"):
        transformer_config(LlamaConfig(**small, attention_bias=True))


def test_the_version_matrix_prints_every_package_and_refuses_known_bad_combinations(monkeypatch):
    """One line per package of the tested matrix here (megatron-core 0.16.1, no TE, flash-attn
    or vLLM in this environment); then, by planting versions: megatron-core outside
    >=0.16.1,<0.20 fails, inside but untested warns, 0.19.x on Python 3.11 warns with how CI
    runs it; a Transformer Engine, flash-attn or vLLM that is installed but does not import
    fails with the import error (megatron-core would stop on a broken TE)."""
    import sys

    from hapo_openrlhf.cluster import doctor

    got = {c.name: c for c in doctor.check_matrix()}
    assert set(got) >= {"matrix python", "matrix torch", "matrix megatron-core", "matrix transformer-engine",
                        "matrix flash-attn", "matrix vllm"}
    assert got["matrix megatron-core"].status == OK and "0.16.1 (tested)" in got["matrix megatron-core"].message
    assert got["matrix transformer-engine"].message.startswith("not installed")

    def plant(versions, broken=()):
        monkeypatch.setattr(doctor, "_version", lambda d: versions.get(d))
        monkeypatch.setattr(doctor, "_imports", lambda m: "OSError: undefined symbol" if m in broken else None)
        return {c.name: c for c in doctor.check_matrix()}

    base = {"torch": "2.13.0"}
    for mc, status, words in (("0.15.0", FAIL, "outside the supported range >=0.16.1,<0.20"),
                              ("0.20.0", FAIL, "outside"), ("0.18.0", WARN, "CI runs 0.16.1, 0.19.2"),
                              ("0.19.2", OK, "tested")):
        c = plant({**base, "megatron-core": mc})["matrix megatron-core"]
        assert c.status == status and words in c.message, (mc, c)
    m = plant({**base, "megatron-core": "0.19.2"})
    assert ("matrix megatron-core/python" in m) == (sys.version_info < (3, 12))
    m = plant({**base, "transformer-engine": "2.20.2", "flash-attn": "2.8.3", "vllm": "0.29.0"},
              broken=("transformer_engine.pytorch", "flash_attn"))
    assert m["matrix transformer-engine"].status == FAIL and "does not import" in m["matrix transformer-engine"].message
    assert m["matrix flash-attn"].status == FAIL and m["matrix vllm"].status == OK
    m = plant({**base, "transformer-engine": "2.12.0"})
    assert m["matrix transformer-engine"].status == WARN and "2.20.2" in m["matrix transformer-engine"].fix


def test_doctor_checks_the_installed_te_against_the_cp_comm_type(monkeypatch):
    """Issue 58: a context-parallel config's comm type against the Transformer Engine installed (a2a
    and all_gather need TE >= 1.10: below it megatron-core would run p2p without a word); no
    line for a config without CP."""
    from hapo_openrlhf.cluster import doctor

    sets = ["megatron.layer_spec=te", "megatron.context_parallel=2", "megatron.pipeline_parallel=1"]
    cfg = load_config(REPO / "configs/qwen25_math_7b_hapo_megatron.yaml", [*sets, "megatron.cp_comm_type=a2a"])

    def checks(te, c=cfg):
        monkeypatch.setattr(doctor, "_version", lambda d: {"transformer-engine": te}.get(d, "1.0"))
        return {k.name: k for k in doctor.check_packages(c)}

    bad = checks("1.9.0")["context parallelism"]
    assert bad.status == FAIL and "cp_comm_type a2a needs transformer-engine >= 1.10.0, installed 1.9.0" in bad.message
    assert "cp_comm_type: p2p" in bad.fix
    assert checks("2.20.2")["context parallelism"].status == OK
    assert "context parallelism" not in checks("2.20.2", load_config(REPO / "configs/qwen25_math_7b_hapo_megatron.yaml"))
