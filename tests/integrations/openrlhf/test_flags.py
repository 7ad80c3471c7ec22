"""The generated OpenRLHF argv, checked by OpenRLHF 0.11.2's real parser and validation."""

import json
import os
from pathlib import Path

import pytest

from hapo_openrlhf.config import load_config
from hapo_openrlhf.integrations.openrlhf.launch.flags import PROGRAM, REWARD_FUNC, build_argv
from tests.conftest import REPO, cli_in_process, run_cli

CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml") if load_config(p).backend in ("openrlhf", "megatron"))
E2E = Path(__file__).with_name("e2e_tiny.yaml")


def test_paper_configs_are_shipped():
    names = {p.stem for p in CONFIGS}
    assert {"qwen25_math_7b_hapo", "deepscaler_1p5b_24k_hapo", "deepscaler_1p5b_preview_8k_hapo",
            "deepscaler_1p5b_preview_16k_hapo", "deepscaler_1p5b_preview_24k_hapo"} <= names
    for q in ("phr", "plr", "nhr", "nlr"):
        assert f"qwen25_math_7b_quadrant_{q}" in names
    for b in ("grpo", "dr_grpo", "dapo", "w_reinf", "entro_reg", "entro_adv", "forking", "kl_cov", "clip_cov", "prime"):
        assert f"qwen25_math_7b_{b}" in names


@pytest.mark.parametrize("path", CONFIGS + [E2E], ids=lambda p: p.stem)
def test_every_config_passes_openrlhf_parser(path, tmp_path):
    from hapo_openrlhf.integrations.openrlhf.launch.train import parse_with_upstream

    overrides = ["model.path=/models/tiny"] if path == E2E else []
    cfg = load_config(path, overrides)
    argv = build_argv(cfg, tmp_path)
    assert argv[0] == PROGRAM
    args = parse_with_upstream(argv)  # argparse exits / OpenRLHF asserts on anything it rejects
    r, a, o = cfg.rollout, cfg.algorithm, cfg.openrlhf
    assert args.actor.model_name_or_path == cfg.model.path
    assert args.rollout.batch_size == r.prompts_per_step
    assert args.rollout.n_samples_per_prompt == r.samples_per_prompt
    assert args.rollout.max_new_tokens == r.max_new_tokens
    assert (args.rollout.temperature, args.rollout.top_p) == (r.temperature, r.top_p)
    assert args.data.max_len == o.max_len
    assert list(args.actor.eps_clip_low_high) == [a.loss_params.get("eps_low", 0.2), a.loss_params.get("eps_high", 0.2)]
    assert args.actor.adam.lr == cfg.optim.lr
    assert args.algo.kl.init_coef == a.kl_coef
    assert args.algo.dynamic_filtering_enable == a.dynamic_sampling
    assert args.critic.model_name_or_path is None  # group estimator: no critic
    assert args.reward.remote_url == [str(REWARD_FUNC)]
    assert args.ds.ring_attn_size == o.ring_attn_size
    assert args.ds.packing_samples == (o.packing_samples or o.ring_attn_size > 1)
    assert args.ckpt.path == str(tmp_path / "ckpt") and args.ckpt.load_enable
    assert args.ckpt.save_steps == (cfg.trainer.save_every or -1)
    assert args.actor.entropy_coef == (0.0 if a.loss in ("entro_reg", "rsi_s") else None)
    assert (args.algo.kl.use_loss, args.algo.kl.estimator) == ((True, "k3") if a.kl_coef > 0 else (False, "k1"))
    # OpenRLHF's "duplicate actors" (ranks fed the same micro-batches) = the Megatron replica's TP x PP
    assert args.ds.tensor_parallel_size == (cfg.megatron.model_parallel_size if cfg.backend == "megatron" else 1)


# arXiv 2604.11056v1 Appendix B, Tables 5-6 (shared/SPEC.md section 3), in OpenRLHF's units:
# rollout.batch_size counts prompts, train.batch_size counts samples (32 prompts x n).
TABLE_7B = dict(model="Qwen/Qwen2.5-Math-7B", prompts=512, n=8, train_batch=256, lr=1e-6, response=3072,
                max_len=1024 + 3072, clip=(0.2, 0.28), temperature=1.0, steps=220, template="qwen25_math")
TABLE_7B_QUADRANT = {**TABLE_7B, "prompts": 256, "steps": 120}
TABLE_1P5B = dict(model="cmu-deepscaler-colab/DeepScaleR-8K", prompts=64, n=16, train_batch=512, lr=1e-6,
                  response=24576, max_len=2048 + 24576, clip=(0.2, 0.28), temperature=1.0, steps=900,
                  template="deepscaler")
BASELINES_7B = ["dapo", "dr_grpo", "w_reinf", "entro_reg", "entro_adv", "forking", "kl_cov", "clip_cov"]
PAPER_TABLE = {
    "qwen25_math_7b_hapo": TABLE_7B, "qwen25_math_7b_hapo_megatron": TABLE_7B,
    "qwen25_math_7b_grpo": {**TABLE_7B, "clip": (0.2, 0.2)},  # vanilla GRPO: symmetric clip
    "qwen25_math_7b_dr_grpo": {**TABLE_7B, "clip": (0.2, 0.2)},
    **{f"qwen25_math_7b_{b}": TABLE_7B for b in BASELINES_7B if b not in ("dr_grpo", "kl_cov")},
    "qwen25_math_7b_kl_cov": {**TABLE_7B, "clip": None},  # KL-Cov is PPO without the clip
    **{f"qwen25_math_7b_quadrant_{q}": TABLE_7B_QUADRANT for q in ("phr", "plr", "nhr", "nlr")},
    "deepscaler_1p5b_24k_hapo": TABLE_1P5B, "deepscaler_1p5b_24k_hapo_megatron": TABLE_1P5B,
}


@pytest.mark.parametrize("name", sorted(PAPER_TABLE))
def test_paper_configs_carry_tables_5_and_6(name, tmp_path, capsys):
    """The argv `hapo train --print-command` prints, read back through OpenRLHF's parser."""
    from hapo_openrlhf.cli import main
    from hapo_openrlhf.integrations.openrlhf.launch.train import parse_with_upstream

    t = PAPER_TABLE[name]
    path = REPO / "configs" / f"{name}.yaml"
    assert main(["train", "--config", str(path), "--print-command", "--output-dir", str(tmp_path)]) == 0
    args = parse_with_upstream(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert args.actor.model_name_or_path == t["model"]
    assert (args.rollout.batch_size, args.rollout.n_samples_per_prompt) == (t["prompts"], t["n"])
    assert args.train.batch_size == t["train_batch"] == 32 * t["n"]  # mini-batch of 32 prompts
    assert args.actor.adam.lr == t["lr"]
    assert (args.rollout.max_new_tokens, args.data.max_len) == (t["response"], t["max_len"])
    if t["clip"]:
        assert tuple(args.actor.eps_clip_low_high) == t["clip"]
    assert args.rollout.temperature == t["temperature"] == 1.0
    assert args.rollout.top_p == 0.95  # paper §6.1: "temperature of 1.0 and top-p of 0.95"
    cfg = load_config(path)
    # verl 0.9's dual clip (clip_ratio_c 3) on its vanilla PPO loss; its KL-Cov / Clip-Cov losses take none
    want_dual = None if cfg.algorithm.loss in ("kl_cov", "clip_cov") else 3.0
    assert args.actor.dual_clip == want_dual and cfg.algorithm.loss_params.get("dual_clip") == want_dual
    assert args.algo.kl.init_coef == 0.0 and not args.algo.kl.use_loss
    assert args.train.max_epochs == 1
    # the step count is the project's limit (OpenRLHF has no max-steps flag): trainer.steps
    # travels in args.hapo to the controller's StepLimit; the episodes must not end the run first
    assert cfg.trainer.steps == t["steps"] and cfg.data.template == t["template"]
    assert t["steps"] * t["prompts"] <= 40_315 * cfg.openrlhf.num_episodes  # DeepScaleR has 40,315 problems
    if cfg.algorithm.estimator == "hapo":
        assert dict(cfg.algorithm.estimator_params) == {"alpha": 0.2, "phi": 2.0}  # the published rule's defaults


def test_megatron_configs_are_shipped_and_checked():
    names = {p.stem for p in CONFIGS if load_config(p).backend == "megatron"}
    assert {"qwen25_math_7b_hapo_megatron", "deepscaler_1p5b_24k_hapo_megatron"} <= names
    base = REPO / "configs/qwen25_math_7b_hapo_megatron.yaml"
    for override, msg in [("megatron.tensor_parallel=3", "must divide the actor world size"),
                          ("megatron.context_parallel=2", "context_parallel > 1 needs megatron.layer_spec: te"),
                          ("megatron.sequence_parallel=true", "layer_spec: te"),
                          ("megatron.attention=local,openrlhf.packing_samples=true", "needs megatron.attention: flash"),
                          ("megatron.attention=sdpa", "flash or local"),
                          ("megatron.layer_spec=tex", "local or te"),
                          ("openrlhf.colocate_all=true", "NCCL refuses"),
                          ("megatron.params_dtype=fp16", "bf16 or fp32"),
                          ("megatron.head=vocab", "auto, fused or logits"),
                          ("megatron.distributed_optimizer=1", "expected true/false"),
                          ("megatron.optimizer_sharding=fully_sharded_model_space",
                           "dp_reshardable or fully_reshardable"),
                          # mixture of experts: EP is carved out of DP (TP 2 x PP 2 on 4 GPUs leaves DP 1)
                          ("megatron.expert_parallel=2", "expert_parallel 2 must divide the data-parallel size x context_parallel 1"),
                          ("megatron.expert_parallel=0", "expert_parallel must be >= 1"),
                          ("megatron.tensor_parallel=1,megatron.pipeline_parallel=1,megatron.expert_parallel=2,"
                           "megatron.moe.dispatcher=allgather", "allgather gathers equal token counts"),
                          ("megatron.moe.dispatcher=flex", "alltoall or allgather"),
                          ("megatron.moe.aux_loss_coeff=-0.01", "aux_loss_coeff must be >= 0"),
                          ("megatron.moe.routing_replay=r4", "off or r3"),
                          ("megatron.moe.routing_replay=r3,megatron.recompute=true",
                           "recomputed forward would replay a later micro-batch's routes")]:
        with pytest.raises(ValueError, match=msg):
            load_config(base, override.split(","))
    # what the Megatron back end now runs: packed THD micro-batches by a token budget; SP with TE's spec
    cfg = load_config(base, ["openrlhf.packing_samples=true", "openrlhf.dynamic_batch=true"])
    assert cfg.openrlhf.packing_samples and cfg.megatron.attention == "flash"
    # TE's spec (fused norms: the converter, weight sync and checkpoints map layer_norm_weight) and, with
    # it, sequence parallelism over TP ranks; what cannot run together is refused by name
    tp2 = ["megatron.tensor_parallel=2"]
    cfg = load_config(base, tp2 + ["megatron.layer_spec=te", "megatron.sequence_parallel=true"])
    assert cfg.megatron.layer_spec == "te" and cfg.megatron.sequence_parallel
    for sets, msg in [(["megatron.layer_spec=te", "megatron.sequence_parallel=true", "megatron.tensor_parallel=1"],
                       "needs tensor_parallel > 1"),
                      (tp2 + ["megatron.layer_spec=te", "megatron.attention=local"], "core attention is Transformer Engine"),
                      (tp2 + ["megatron.sequence_parallel=true"], "needs megatron.layer_spec: te")]:
        with pytest.raises(ValueError, match=msg):
            load_config(base, sets)


def test_megatron_kl_reference_is_a_megatron_group(tmp_path):
    """``algorithm.kl_coef > 0`` on the Megatron back end: OpenRLHF's driver builds its reference
    group from hapo's Megatron reference actor (restored afterwards), with the policy's GPU
    count and duplicate factor, the k3 loss, and upstream's reference ``forward`` signature."""
    import inspect

    import openrlhf.cli.train_ppo_ray as cli
    from openrlhf.trainer.ray.launcher import ReferenceModelActor

    from hapo_openrlhf.integrations.openrlhf.actors.megatron_reference import MegatronReferenceActor, MegatronReferenceActorImpl
    from hapo_openrlhf.integrations.openrlhf.launch.train import installed, parse_with_upstream

    cfg = load_config(REPO / "configs/qwen25_math_7b_hapo_megatron.yaml", ["algorithm.kl_coef=0.01"])
    args = parse_with_upstream(build_argv(cfg, tmp_path))
    assert args.algo.kl.init_coef == 0.01 and args.algo.kl.use_loss and args.algo.kl.estimator == "k3"
    assert (args.ref.num_nodes, args.ref.num_gpus_per_node) == (args.actor.num_nodes, args.actor.num_gpus_per_node)
    assert args.ds.tensor_parallel_size == cfg.megatron.model_parallel_size  # the reference's duplicate factor too
    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_reference import HapoReferenceModelActor

    before = cli.ReferenceModelActor
    with installed("megatron"):
        assert cli.ReferenceModelActor is MegatronReferenceActor
    with installed("openrlhf"):
        assert cli.ReferenceModelActor is HapoReferenceModelActor
    assert cli.ReferenceModelActor is before
    up = ReferenceModelActor.__ray_actor_class__
    for m in ("forward", "init_model_from_pretrained"):
        assert list(inspect.signature(getattr(MegatronReferenceActorImpl, m)).parameters) == \
            list(inspect.signature(getattr(up, m)).parameters), m


def test_24k_config_long_context_flags(tmp_path):
    from hapo_openrlhf.integrations.openrlhf.launch.train import parse_with_upstream

    args = parse_with_upstream(build_argv(load_config(REPO / "configs/deepscaler_1p5b_24k_hapo.yaml"), tmp_path))
    assert args.ds.ring_attn_size == 2 and args.ds.packing_samples and args.train.dynamic_batch_enable
    assert args.data.max_len == 26624 and args.rollout.max_new_tokens == 24576
    assert args.ds.attn_implementation == "flash_attention_2"


def test_print_command_is_the_argv(tmp_path):
    cfg = REPO / "configs/qwen25_math_7b_hapo.yaml"
    p = run_cli(["train", "--config", str(cfg), "--print-command", "--output-dir", str(tmp_path)])
    assert p.returncode == 0, p.stderr
    argv = json.loads(p.stdout.strip().splitlines()[-1])
    assert argv == build_argv(load_config(cfg), tmp_path)
    assert not any(tmp_path.iterdir())  # started nothing, wrote nothing
    # --backend overrides the config's; the local config needs a model path for OpenRLHF
    p = cli_in_process(["train", "--config", str(REPO / "configs/cpu_tiny.yaml"), "--backend", "openrlhf",
                        "--print-command"])
    assert p.returncode == 2 and "model.path" in p.stderr


@pytest.mark.parametrize("override, msg", [
    ("openrlhf.train_batch_size=96", "must divide the rollout batch"),
    ("openrlhf.micro_train_batch_size=3", "multiple of micro_train_batch_size"),
    ("rollout.max_new_tokens=5000", "must be < openrlhf.max_len"),
    ("openrlhf.ring_attn_size=3", "must divide the actor world size"),
    ("openrlhf.zero_stage=4", "zero_stage must be 0-3"),
    ("openrlhf.bogus=1", "openrlhf.bogus"),
    ('openrlhf.extra_args=["--actor.adam.lr", "1e-5"]', "--actor.adam.lr is generated from the config"),
    ('openrlhf.extra_args=["--train.seed=3"]', "--train.seed is generated from the config"),
    ('openrlhf.extra_args=["--algo.advantage.is_correction_level", "token"]', "set algorithm.is_correction.level"),
    ('openrlhf.extra_args=["--algo.advantage.is_correction_threshold=2"]', "set algorithm.is_correction.threshold"),
    # argparse abbreviations, resolved by OpenRLHF's own parser (each overrides a generated flag there)
    ('openrlhf.extra_args=["--ckpt.pat", "/elsewhere"]', "--ckpt.pat \\(OpenRLHF reads it as --ckpt.path\\) is generated"),
    ('openrlhf.extra_args=["--train.see=3"]', "--train.see \\(OpenRLHF reads it as --train.seed\\) is generated"),
    ('openrlhf.extra_args=["--reward.remote", "x.py"]', "reads it as --reward.remote_url\\) is generated"),
    ('openrlhf.extra_args=["--algo.advantage.is_correction_lev", "seq"]', "set algorithm.is_correction.level"),
    ('openrlhf.extra_args=["--actor.ad=1"]', "--actor.ad is ambiguous in OpenRLHF's parser"),
    ('openrlhf.extra_args=["--no.such_option"]', "--no.such_option is not an option of OpenRLHF"),
    ("algorithm.is_correction={level: seq, mode: clip}", "requires is_correction_level=token"),
    ("algorithm.is_correction={level: token, gating: tv, threshold: [0.5, 2]}", "takes an upper bound only"),
    ("algorithm.is_correction={level: token, behaviour: sampled}", "behaviour must be one of \\('raw', 'processed'\\)"),
])
def test_bad_cluster_settings_are_named(override, msg):
    with pytest.raises(ValueError, match=msg):
        build_argv(load_config(REPO / "configs/qwen25_math_7b_hapo.yaml", [override]))


def test_extra_args_abbreviations_really_override_in_openrlhfs_parser(tmp_path):
    """The refusals above are not over-cautious: OpenRLHF's own parser takes each
    abbreviation as the generated option and the last value wins."""
    from hapo_openrlhf.integrations.openrlhf.launch.train import parse_with_upstream

    argv = build_argv(load_config(REPO / "configs/qwen25_math_7b_hapo.yaml"), tmp_path)
    args = parse_with_upstream(argv + ["--ckpt.pat", "/elsewhere", "--train.see=3"])
    assert args.ckpt.path == "/elsewhere" and args.train.seed == 3


def test_extra_args_that_add_options_still_pass(tmp_path):
    cfg = load_config(REPO / "configs/qwen25_math_7b_hapo.yaml", ['openrlhf.extra_args=["--logger.wandb.group", "x"]'])
    assert build_argv(cfg, tmp_path)[-2:] == ["--logger.wandb.group", "x"]


@pytest.mark.parametrize("spec, want", [
    ("{level: token, mode: clip, threshold: [0.5, 2.0]}", ("token", "clip", "ratio", [0.5, 2.0])),
    ("{level: seq, gating: binary_kl, threshold: [0.001]}", ("seq", "mask", "binary_kl", [0.0, 0.001])),
])
def test_is_correction_section_reaches_openrlhf_and_hapos_loss(tmp_path, spec, want):
    """algorithm.is_correction -> OpenRLHF's --algo.advantage.is_correction_* (so it asks vLLM
    for log-probs) and the same setting in args.hapo for hapo's loss; off emits nothing."""
    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_actor import loss_from_config
    from hapo_openrlhf.integrations.openrlhf.launch.train import parse_with_upstream

    cfg = load_config(REPO / "configs/qwen25_math_7b_hapo.yaml", [f"algorithm.is_correction={spec}"])
    args = parse_with_upstream(build_argv(cfg, tmp_path))
    a = args.algo.advantage
    assert (a.is_correction_level, a.is_correction_mode, a.is_correction_gating,
            list(a.is_correction_threshold)) == want
    loss = loss_from_config(cfg)
    assert (loss.is_correction.level, loss.is_correction.mode, loss.is_correction.gating,
            list(loss.is_correction.threshold)) == want
    off = build_argv(load_config(REPO / "configs/qwen25_math_7b_hapo.yaml"), tmp_path)
    assert not any(t.startswith("--algo.advantage.is_correction") for t in off)


@pytest.mark.parametrize("sets, want", [
    ([], None),  # correction off: OpenRLHF asks for no log-probs
    (["algorithm.is_correction={level: token}", "rollout.top_p=0.95"], "raw_logprobs"),  # the default, T 1
    (["algorithm.is_correction={level: token, behaviour: processed}", "rollout.top_p=0.95"], "processed_logprobs"),
    # T != 1 with nothing truncated: processed = the full vocabulary at T
    (["algorithm.is_correction={level: token}", "rollout.temperature=0.7", "rollout.top_p=1.0"], "processed_logprobs"),
    (["algorithm.is_correction={level: token, behaviour: processed}", "rollout.temperature=0.7"], "processed_logprobs"),
])
def test_behaviour_picks_vllms_logprobs_mode(sets, want):
    from hapo_openrlhf.integrations.openrlhf.launch.flags import engine_logprobs_mode

    assert engine_logprobs_mode(load_config(REPO / "configs/qwen25_math_7b_hapo.yaml", sets)) == want


def test_raw_behaviour_at_another_temperature_under_top_p_is_refused_by_name(tmp_path):
    cfg = load_config(REPO / "configs/qwen25_math_7b_hapo.yaml", [
        "algorithm.is_correction={level: token}", "rollout.temperature=0.7", "rollout.top_p=0.95"])
    with pytest.raises(ValueError, match="behaviour=raw needs rollout.temperature 1.0 or rollout.top_p 1.0"):
        build_argv(cfg, tmp_path)
    p = cli_in_process(["train", "--config", "configs/qwen25_math_7b_hapo.yaml", "--print-command", "--set",
                        "algorithm.is_correction={level: token}", "--set", "rollout.temperature=0.7", "--set",
                        "rollout.top_p=0.95"])
    assert p.returncode == 2 and "algorithm.is_correction.behaviour=raw needs" in p.stderr


def test_logprobs_mode_seam_on_upstreams_create_vllm_engines():
    """train.installed swaps only the logprobs_mode OpenRLHF passes (processed_logprobs when
    the correction is on, None when off), bound by upstream's real signature; restored after."""
    import inspect

    import openrlhf.cli.train_ppo_ray as cli
    from openrlhf.trainer.ray.vllm_engine import create_vllm_engines

    from hapo_openrlhf.integrations.openrlhf.launch.train import installed, with_logprobs_mode

    calls = []

    def fake(*args, **kwargs):
        calls.append(inspect.signature(create_vllm_engines).bind(*args, **kwargs).arguments)

    fake.__signature__ = inspect.signature(create_vllm_engines)
    wrapped = with_logprobs_mode(fake, "raw_logprobs")
    # as train_ppo_ray calls it: 12 positional arguments, then keywords
    wrapped(1, 1, "m", 7, False, False, True, 64, None, 0.9, False, "processed_logprobs", agent_func_path=None,
            remote_rm_url="r.py", max_images_per_prompt=0)
    wrapped(1, 1, "m", 7, False, False, True, 64, None, 0.9, False, None, remote_rm_url="r.py")
    assert [c["logprobs_mode"] for c in calls] == ["raw_logprobs", None]
    assert calls[0]["remote_rm_url"] == "r.py" and calls[0]["max_model_len"] == 64
    with pytest.raises(RuntimeError, match="no logprobs_mode parameter"):
        with_logprobs_mode(lambda a, b: None, "raw_logprobs")
    saved = cli.create_vllm_engines
    with installed("openrlhf", "raw_logprobs"):
        assert cli.create_vllm_engines is not saved and cli.create_vllm_engines.__wrapped__ is saved
    with installed("openrlhf", None):  # correction off: upstream's own function
        assert cli.create_vllm_engines is saved
    assert cli.create_vllm_engines is saved


@pytest.mark.parametrize("backend", ["openrlhf", "megatron"])
@pytest.mark.parametrize("flash", [True, False])
def test_gpu_smoke_configs_load_and_pass_openrlhf_parser(backend, flash, tmp_path):
    """`hapo doctor --gpu-smoke` runs OpenRLHF's loop from these configs on a GPU; here, up to
    where CUDA is needed: the config loads and OpenRLHF's parser accepts its argv."""
    import yaml

    from hapo_openrlhf.gpu_smoke import smoke_run_config
    from hapo_openrlhf.integrations.openrlhf.launch.train import parse_with_upstream

    raw = smoke_run_config(tmp_path / "model", backend, flash_attn=flash)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(tmp_path / "c.yaml")
    args = parse_with_upstream(build_argv(cfg, tmp_path / "run"))
    assert args.rollout.batch_size == 4 and args.ckpt.save_steps == 1 and cfg.trainer.steps == 2
    if backend == "openrlhf":  # one GPU: the engine sleeps while the actor trains (CUDA IPC weight sync)
        assert args.train.colocate_all and args.vllm.enable_sleep and args.ds.packing_samples == flash
    else:
        assert not args.train.colocate_all and cfg.megatron.tensor_parallel == 1


def test_qwen3_extra_is_the_7b_megatron_setting_on_qwen3():
    """configs/qwen3_8b_base_hapo_megatron.yaml (an extra, not the paper's) changes only the
    model (and the run's names) from the paper's 7B Megatron setting."""
    extra = load_config(REPO / "configs/qwen3_8b_base_hapo_megatron.yaml").to_dict()
    paper = load_config(REPO / "configs/qwen25_math_7b_hapo_megatron.yaml").to_dict()
    assert extra["model"].pop("path") == "Qwen/Qwen3-8B-Base"
    paper["model"].pop("path")
    for k in ("run_name", "output_dir"):
        assert "qwen3_8b_base" in str(extra.pop(k)) and paper.pop(k)
    assert extra == paper


def test_fp16_is_refused_for_the_reason_openrlhfs_own_source_gives():
    """issue 43: OpenRLHF 0.11.2 builds its vLLM engines in bf16 and asserts each synced
    weight's dtype, so an fp16 DeepSpeed actor would crash at the first weight sync. The
    refusal names both places; this checks they still say so in the installed OpenRLHF."""
    import importlib.util

    root = Path(importlib.util.find_spec("openrlhf").submodule_search_locations[0]) / "trainer" / "ray"
    engine, worker = (root / "vllm_engine.py").read_text(), (root / "vllm_worker_wrap.py").read_text()
    assert '"dtype": "bfloat16"' in engine and "def create_vllm_engines" in engine
    assert "assert dtype == self.model_config.dtype" in worker
    with pytest.raises(ValueError, match="openrlhf.param_dtype: fp16 cannot run: OpenRLHF 0.11.2 creates every vLLM "
                                         "engine with dtype bfloat16 .* fails at the first weight sync; use bf16"):
        load_config(REPO / "configs" / "qwen25_math_7b_hapo.yaml", ["openrlhf.param_dtype=fp16"])
    with pytest.raises(ValueError, match="--ds.param_dtype is generated from the config"):
        build_argv(load_config(REPO / "configs" / "qwen25_math_7b_hapo.yaml",
                               ["openrlhf.extra_args=[--ds.param_dtype, fp16]"]), Path("/tmp/x"))


def test_a_loss_that_reads_the_current_entropy_gets_it_from_openrlhf(tmp_path):
    """rsi_s (like entro_reg) takes the current policy's entropy: the argv asks OpenRLHF's
    training forward for it, at coefficient 0 (upstream adds no term; hapo's loss uses it)."""
    from hapo_openrlhf.integrations.openrlhf.launch.train import parse_with_upstream

    cfg = load_config(E2E, ["model.path=/models/tiny", "algorithm.loss=rsi_s",
                            "algorithm.loss_params={lower: 0.5, upper: null}"])
    args = parse_with_upstream(build_argv(cfg, tmp_path))
    assert args.actor.entropy_coef == 0.0


def test_a_moe_layout_the_actor_cannot_serve_is_refused_before_anything_starts(tmp_path):
    """`hapo train` with backend megatron and a local Qwen3-MoE directory: the layout is checked
    against its config.json (families.check_actor_family) before Ray, the run lock or any file of
    the run: one named line, exit 2."""
    from tests.integrations.openrlhf.conftest import moe_config_dir

    # transformers 5.15 writes the expert count as num_local_experts (Qwen's releases: num_experts)
    model = tmp_path / "moe"
    moe_config_dir(model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_local_experts"] = cfg.pop("num_experts")
    (model / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "run"
    ep4 = ["megatron.tensor_parallel=1", "megatron.pipeline_parallel=1", "megatron.expert_parallel=4",
           f"model.path={model}"]
    p = run_cli(["train", "--config", "configs/qwen25_math_7b_hapo_megatron.yaml", "--output-dir", str(out),
                 *[x for kv in ep4 for x in ("--set", kv)]], timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "cannot lay out this Qwen3-MoE model: num_experts 6 is not divisible by expert parallel size 4" in p.stderr
    assert not out.exists() or not any(out.iterdir())


def test_prime_on_openrlhf_builds_its_prm_group_from_the_config(tmp_path):
    """PRIME's 7B config (the recipe's settings) through OpenRLHF's parser: no critic asked of OpenRLHF
    by the flags (hapo adds the PRM group in the critic slot after parsing, launch/train.py), the
    recipe's n 4 x 64 prompts and actor lr; the PRM's batches cut evenly over the actors; refused by
    name: OpenRLHF's dynamic batch, a PRM mini-batch that is not whole micro-batches per actor."""
    from hapo_openrlhf.config.prm import openrlhf_prm_batches
    from hapo_openrlhf.integrations.openrlhf.launch.train import parse_with_upstream

    base = REPO / "configs/qwen25_math_7b_prime.yaml"
    cfg = load_config(base)
    args = parse_with_upstream(build_argv(cfg, tmp_path))
    assert args.critic.model_name_or_path is None and args.algo.advantage.estimator != "gae"
    assert (args.rollout.batch_size, args.rollout.n_samples_per_prompt, args.actor.adam.lr) == (64, 4, 5e-7)
    assert (cfg.prm.update, cfg.prm.lr, cfg.prm.grad_clip, dict(cfg.algorithm.estimator_params)["beta"]) == \
        ("before", 1e-6, 10.0, 0.05)
    assert openrlhf_prm_batches(cfg, 8) == (256, 8)  # the whole batch per step: 32 rows (4 micro-batches) per actor
    for sets, msg in ((["openrlhf.dynamic_batch=true"], "openrlhf.dynamic_batch with PRIME"),
                      (["prm.mini_batch_size=96"], "prm.mini_batch_size 96 must divide the rollout batch"),
                      (["prm.mini_batch_size=32"], "be whole micro-batches \\(openrlhf.micro_rollout_batch_size 8\\) "
                                                   "on each of the PRM group's 8 actors")):
        with pytest.raises(ValueError, match=msg):
            build_argv(load_config(base, sets), tmp_path)


def test_prime_on_openrlhf_checks_its_prm_models_before_anything_starts(tmp_path):
    """prm.path / prm.ref_path on OpenRLHF, checked at launch as the embedded trainer checks them: a
    missing directory, one without a model's config, a vocabulary other than the policy's -- one named
    line each; the policy's own vocabulary and a hub id pass (the actors download it)."""
    from hapo_openrlhf.integrations.openrlhf.launch.train import check_prm_models

    def model(name, vocab):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": vocab}))
        return str(d)

    policy, same, other = model("policy", 151_936), model("same", 151_936), model("other", 152_064)
    empty = tmp_path / "e"
    empty.mkdir()
    base = REPO / "configs/qwen25_math_7b_prime.yaml"

    def check(*sets):
        check_prm_models(load_config(base, [f"model.path={policy}", *sets]))

    check(f"prm.path={same}", f"prm.ref_path={same}")
    check("prm.path=Qwen/Qwen2.5-Math-7B")  # a hub id: the actors' download
    for sets, msg in (([f"prm.path={tmp_path / 'gone'}"], "prm.path '.*gone' does not exist"),
                      ([f"prm.ref_path={empty}"], "prm.ref_path '.*e' holds no config.json"),
                      ([f"prm.ref_path={other}"], "prm.ref_path '.*other' has a vocabulary of 152064 tokens, the "
                                                  "policy \\(.*policy\\) 151936")):
        with pytest.raises(ValueError, match=msg):
            check(*sets)
    check_prm_models(load_config(REPO / "configs/qwen25_math_7b_hapo.yaml", [f"prm.path={tmp_path / 'gone'}"]))


def test_every_hapo_actor_announces_a_port_outside_the_ephemeral_range(monkeypatch):
    """Rank 0 of each actor group hapo installs (policy, KL reference, PRM; DeepSpeed and Megatron)
    picks its ``MASTER_PORT`` through cluster/ports.py, not upstream's ``bind(port 0)``: the CI run
    that failed with EADDRINUSE on a Megatron actor's TCPStore drew an ephemeral port."""
    from openrlhf.trainer.ray.launcher import BaseDistributedActor

    from hapo_openrlhf.cluster.ports import OutsideEphemeralPort, ephemeral_range
    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_actor import HapoPolicyModelActorImpl
    from hapo_openrlhf.integrations.openrlhf.actors.deepspeed_reference import HapoReferenceModelActorImpl
    from hapo_openrlhf.integrations.openrlhf.actors.megatron_actor import MegatronPolicyActorImpl
    from hapo_openrlhf.integrations.openrlhf.actors.megatron_reference import MegatronReferenceActorImpl
    from hapo_openrlhf.integrations.openrlhf.actors.prm_actor import HapoPRMActor

    lo, hi = ephemeral_range()
    for cls in (HapoPolicyModelActorImpl, HapoReferenceModelActorImpl, MegatronPolicyActorImpl,
                MegatronReferenceActorImpl, HapoPRMActor.__ray_actor_class__):
        assert issubclass(cls, BaseDistributedActor), cls
        assert cls._get_free_port is OutsideEphemeralPort._get_free_port, cls
        assert not lo <= cls._get_free_port() <= hi, cls
        for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):  # upstream's __init__ sets them
            monkeypatch.setenv(k, "")
        rank0 = cls(1, 0, "127.0.0.1", None)  # upstream's constructor: rank 0 draws the group's port
        addr, port = rank0.get_master_addr_port()
        assert addr == "127.0.0.1" and not lo <= port <= hi and os.environ["MASTER_PORT"] == str(port), cls
