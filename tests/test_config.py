import pickle
import re
from pathlib import Path

import pytest

from hapo_openrlhf.config import RunConfig, apply_overrides, dump_config, from_dict, load_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_round_trips(path):
    cfg = load_config(path)
    again = from_dict(RunConfig, __import__("yaml").safe_load(dump_config(cfg)))
    assert again == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_cpu_tiny_uses_paper_hapo_defaults():
    cfg = load_config(REPO / "configs/cpu_tiny.yaml")
    assert cfg.algorithm.estimator == "hapo"
    assert (cfg.algorithm.estimator_params["alpha"], cfg.algorithm.estimator_params["phi"]) == (0.2, 2.0)


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"trainr": {}}, "unknown config key 'trainr' \\(did you mean 'trainer'\\?\\)"),
        ({"seed": -1}, "seed must be an integer in \\[0, 2\\^32 - 100\\)"),
        ({"seed": 2**32}, "seed must be an integer in"),
        ({"optim": {"lrr": 1e-4}}, "unknown config key 'optim.lrr' \\(did you mean 'optim.lr'\\?\\)"),
        ({"algorithm": {"estimator": "hapoo"}}, "unknown advantage estimator 'hapoo'"),
        ({"algorithm": {"estimator_params": {"alpha": 2.5}}}, "hapo.alpha \\(2.5\\) must be < hapo.phi \\(2\\)"),
        ({"algorithm": {"estimator_params": {"alpha": 0.6, "form": "multiplicative"}}}, "alpha \\* hapo.phi = 1.2 >= 1"),
        ({"algorithm": {"quadrant_split": "median"}}, "algorithm.quadrant_split must be one of"),
        ({"algorithm": {"quadrant_split": "value"}}, "needs algorithm.quadrant_threshold"),
        ({"algorithm": {"estimator": "grpo", "estimator_params": {"alpha": 0.1}}}, "has no parameter"),
        ({"algorithm": {"loss_params": {"eps_low": 1.5}}}, "eps_low must be in"),
        ({"algorithm": {"aggregation": "sum"}}, "aggregation must be one of"),
        ({"rollout": {"samples_per_prompt": 1}}, "samples_per_prompt must be >= 2"),
        ({"rollout": {"temperature": "hot"}}, "rollout.temperature: expected a number"),
        ({"trainer": {"steps": 1.5}}, "trainer.steps: expected an integer"),
        ({"backend": "jax"}, "backend must be"),
        ({"algorithm": {"estimator": "quadrant", "estimator_params": {"quadrants": ["XYZ"]}}}, "unknown quadrant"),
        ({"data": {"template": "llama"}}, "data.template must be one of"),
        ({"model": {"family": "mistral"}}, "model.family must be one of qwen2, qwen3, llama, got 'mistral'"),
        ({"data": {"synthetic": {"min_terms": 7}}}, "data.synthetic.min_terms must be in \\[2, n_terms=3\\], got 7"),
        ({"data": {"synthetic": {"skip_error": 2}}}, "data.synthetic.skip_error must be in \\[0, 1\\], got 2"),
        ({"rollout": {"old_logprobs": "vllm"}}, "rollout.old_logprobs must be auto, sampler or forward, got 'vllm'"),
        ({"backend": "openrlhf", "model": {"path": "m"}, "rollout": {"old_logprobs": "sampler"}},
         "rollout.old_logprobs: sampler is the embedded trainer's \\(backend local\\); backend openrlhf recomputes"),
    ],
)
def test_bad_configs_name_the_problem(raw, match):
    with pytest.raises(ValueError, match=match):
        from_dict(RunConfig, raw)


def test_config_is_frozen():
    cfg = from_dict(RunConfig, {"algorithm": {"estimator_params": {"alpha": 0.1}}})
    with pytest.raises(Exception):
        cfg.seed = 3
    with pytest.raises(TypeError, match="read-only"):
        cfg.algorithm.estimator_params["alpha"] = 0.4


def test_overrides_and_scientific_notation(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optim:\n  lr: 1e-4\n")
    cfg = load_config(p, ["trainer.steps=3", "algorithm.estimator=grpo", "algorithm.estimator_params={}"])
    assert cfg.optim.lr == 1e-4 and cfg.trainer.steps == 3 and cfg.algorithm.estimator == "grpo"
    with pytest.raises(ValueError, match="must look like"):
        apply_overrides({}, ["trainer.steps"])


def test_an_off_switch_written_bare_in_yaml_reads_as_off(tmp_path):
    """YAML 1.1 reads a bare `off` as false: the "off | ..." switches (their default is "off") take
    it as "off"; any other boolean is still refused by name."""
    p = tmp_path / "c.yaml"
    p.write_text("algorithm:\n  is_correction: {level: off}\nmegatron:\n  moe: {routing_replay: off}\n")
    cfg = load_config(p)
    assert cfg.algorithm.is_correction.level == "off" and cfg.megatron.moe.routing_replay == "off"
    assert load_config(p, ["megatron.moe.routing_replay=r3"]).megatron.moe.routing_replay == "r3"
    # a bare `on` (YAML's true) names the switch's modes (issue 55: it was "expected a string, got True")
    with pytest.raises(ValueError, match="megatron.moe.routing_replay: YAML reads a bare on / true / yes as true, "
                                         "and this switch is off or r3: write r3, or off"):
        load_config(p, ["megatron.moe.routing_replay=on"])
    with pytest.raises(ValueError, match="algorithm.is_correction.level: .* write token or seq, or off"):
        load_config(p, ["algorithm.is_correction.level=yes"])
    with pytest.raises(ValueError, match="run_name: expected a string, got False"):
        load_config(p, ["run_name=off"])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_base_chain_merges_sections_and_replaces_param_maps(tmp_path):
    (tmp_path / "a.yaml").write_text("seed: 1\noptim: {lr: 0.5, grad_clip: 2.0}\n"
                                     "algorithm: {estimator: hapo, estimator_params: {alpha: 0.1, ablate: [PLR]}}\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\noptim: {lr: 0.25}\nalgorithm: {estimator: grpo, estimator_params: {}}\n")
    cfg = load_config(tmp_path / "b.yaml")
    assert (cfg.seed, cfg.optim.lr, cfg.optim.grad_clip) == (1, 0.25, 2.0)
    assert cfg.algorithm.estimator == "grpo" and dict(cfg.algorithm.estimator_params) == {}
    (tmp_path / "c.yaml").write_text("base: d.yaml\n")
    (tmp_path / "d.yaml").write_text("base: c.yaml\n")
    with pytest.raises(ValueError, match="config base cycle"):
        load_config(tmp_path / "c.yaml")


def test_baseline_configs_select_their_algorithms():
    got = {p.stem: load_config(p).algorithm for p in (REPO / "configs").glob("cpu_tiny_*.yaml")}
    assert got["cpu_tiny_dapo"].dynamic_sampling and got["cpu_tiny_dapo"].overlong.enable
    assert got["cpu_tiny_grpo"].aggregation == "seq-mean-token-mean"
    for plain in ("cpu_tiny_grpo", "cpu_tiny_dr_grpo"):  # no DAPO pieces inherited from the HAPO base
        assert not got[plain].dynamic_sampling and not got[plain].overlong.enable
    assert got["cpu_tiny_kl_cov"].loss == "kl_cov"
    assert got["cpu_tiny_stare"].loss == "stare" and got["cpu_tiny_stare"].loss_params["dual_clip"] == 10.0
    assert got["cpu_tiny_quadrant_nhr"].estimator_params["quadrants"] == ("NHR",)
    # the methods whose values are unpublished: the configs set them (and say they are theirs)
    assert got["cpu_tiny_paec"].loss == "paec" and got["cpu_tiny_paec"].loss_params["mask"] == "product"
    assert got["cpu_tiny_rsi_s"].loss_params == {"lower": 0.1, "upper": 10.0, "eps_low": 0.2, "eps_high": 0.28}
    for name in ("cpu_tiny_paec", "cpu_tiny_rsi_s"):
        assert "ours" in (REPO / "configs" / f"{name}.yaml").read_text()
    # PRIME at its recipe's settings (run_prime_qwen.sh, prime_trainer.yaml) but beta, scaled to the
    # embedded default's response length (the config says so, with its measurements)
    p = got["cpu_tiny_prime"]
    assert "Ours, measured: beta 4" in (REPO / "configs" / "cpu_tiny_prime.yaml").read_text()
    assert p.estimator == "prime" and dict(p.estimator_params) == {
        "beta": 4.0, "lam": 0.0, "granularity": "token", "norm": "batch_norm", "reward_dpo_coef": 5.0,
        "reward_gt_coef": 5.0}
    f = p.accuracy_filter
    assert (f.enable, f.lower, f.upper, f.oversample, f.drop_truncated) == (True, 0.2, 0.8, 4.0, True)
    assert p.loss == "entro_reg" and dict(p.loss_params) == {"beta": 1e-3, "eps_low": 0.2, "eps_high": 0.2}
    prm = load_config(REPO / "configs" / "cpu_tiny_prime.yaml").prm
    assert (prm.update, prm.loss, prm.weight_decay, prm.grad_clip) == ("before", "ce", 0.0, 10.0)


def _numeric_keys(cls=None, prefix=""):
    """Every int / float config key (optional ones included), as dotted names."""
    import dataclasses
    import types
    import typing

    from hapo_openrlhf.config import RunConfig

    cls = cls or RunConfig
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], prefix + f.metadata.get("key", f.name)
        args = [a for a in typing.get_args(tp) if a is not type(None)] \
            if typing.get_origin(tp) in (typing.Union, types.UnionType) else [tp]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            yield from _numeric_keys(args[0], key + ".")
        elif any(a in (int, float) for a in args):
            yield key


NUMERIC_KEYS = sorted(_numeric_keys())


def test_the_numeric_key_walk_finds_every_section():
    sections = {k.split(".")[0] for k in NUMERIC_KEYS}
    assert {"model", "data", "warmup", "rollout", "algorithm", "optim", "trainer", "eval", "openrlhf", "megatron",
            "slurm", "seed"} <= sections, sections
    assert len(NUMERIC_KEYS) > 60


@pytest.mark.parametrize("bad", [".inf", "-.inf", ".nan", "[1]", "'x'", "{a: 1}"])
def test_every_numeric_key_refuses_inf_nan_lists_and_strings_by_name(bad):
    """Each int / float key of every section, given inf, NaN, a list, a string or a mapping:
    one ValueError naming that key -- never an OverflowError, a TypeError, or a run."""
    import re

    from hapo_openrlhf.config import load_config

    cfg = REPO / "configs" / "cpu_tiny.yaml"
    for key in NUMERIC_KEYS:
        with pytest.raises(ValueError, match=re.escape(key)) as e:
            load_config(cfg, [f"{key}={bad}"])
        assert not re.search(r"\b[A-Z]\w*(Error|Exception)\b", str(e.value)), (key, str(e.value))


def test_method_numbers_as_users_write_them_and_float32s_range():
    """issue 55: a method parameter accepts what the typed keys accept -- YAML 1.1 reads ``1e-3``
    (an exponent without a dot) as a string -- and every float parameter must fit float32, the
    computation's dtype, named at load: past 3.4e38 it overflows to inf, a non-zero value below
    1.2e-38 underflows to 0 (PAEC's softness 1e-320 made every masked entropy NaN)."""
    paec = "{beta: 1e-3, rho_min: 2.0, top_p: 0.9, mask: product, softness: 0.0, anchor_steps: 2}"
    cfg = load_config(REPO / "configs/cpu_tiny.yaml", ["algorithm.loss=paec", f"algorithm.loss_params={paec}"])
    assert cfg.algorithm.loss_params["beta"] == 0.001 and isinstance(cfg.algorithm.loss_params["beta"], float)
    cfg = load_config(REPO / "configs/cpu_tiny_hapo_ablate_plr.yaml", ["algorithm.estimator_params.alpha=2E-1"])
    assert cfg.algorithm.estimator_params["alpha"] == 0.2
    for sets, named in [
        (["algorithm.estimator=eapo_entropic", "algorithm.estimator_params={kappa: 1.0e+39}"], "kappa = 1e+39"),
        (["algorithm.loss=stare", "algorithm.loss_params={w_max: 1.0e+300}"], "w_max = 1e+300"),
        (["algorithm.estimator=pepo", "algorithm.estimator_params={temperature: 1.0e-320}"], "temperature = 1e-320"),
        (["algorithm.loss=paec", f"algorithm.loss_params={paec.replace('softness: 0.0', 'softness: 1.0e-320')}"],
         "softness = 1e-320"),
    ]:
        with pytest.raises(ValueError, match=re.escape(named) + " is outside what float32 .* holds"):
            load_config(REPO / "configs/cpu_tiny.yaml", sets)
    with pytest.raises(ValueError, match=r"upper must be a finite number or null, got inf \(null, not .inf, means no"):
        load_config(REPO / "configs/cpu_tiny_rsi_s.yaml", ["algorithm.loss_params.upper=.inf"])
    with pytest.raises(ValueError, match="beta must be a finite number, got 'abc'"):
        load_config(REPO / "configs/cpu_tiny.yaml", ["algorithm.loss=paec",
                                                     f"algorithm.loss_params={paec.replace('1e-3', 'abc')}"])


@pytest.mark.parametrize("spelled", ["ERPO", "EP-GRPO", "Papo"])
def test_refused_methods_as_the_papers_spell_them_get_the_reason(spelled):
    with pytest.raises(ValueError, match=f"advantage estimator '{spelled}' is not implemented, by design: "):
        load_config(REPO / "configs/cpu_tiny.yaml", [f"algorithm.estimator={spelled}"])
    with pytest.raises(ValueError, match=f"policy loss '{spelled}' is not implemented, by design: "):
        load_config(REPO / "configs/cpu_tiny.yaml", [f"algorithm.loss={spelled}"])


def test_an_implemented_method_as_its_paper_spells_it_gets_the_registrys_name():
    with pytest.raises(ValueError, match="unknown advantage estimator 'PRIME'; did you mean 'prime'"):
        load_config(REPO / "configs/cpu_tiny.yaml", ["algorithm.estimator=PRIME"])


def test_every_choice_is_typed_once_and_refused_by_name_outside_its_literal():
    """Issue 56: a section's choices are its field's ``Literal[...]`` type (``config.choices``), the one
    list the section's check reads; its default is one of them, and a value outside is refused naming
    the dotted key -- for every Literal-typed field of every section."""
    import dataclasses
    import typing

    from hapo_openrlhf import config as C

    sections = {C.RunConfig: "", C.ModelConfig: "model", C.DataConfig: "data", C.RolloutConfig: "rollout",
                C.ISCorrectionConfig: "algorithm.is_correction", C.OpenRLHFConfig: "openrlhf",
                C.MegatronConfig: "megatron", C.MegatronMoEConfig: "megatron.moe"}
    seen = 0
    for cls, prefix in sections.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if typing.get_origin(hints[f.name]) is not typing.Literal:
                continue
            seen += 1
            assert C.choices(cls, f.name) == typing.get_args(hints[f.name]) and f.default in C.choices(cls, f.name)
            with pytest.raises(ValueError, match=rf"{prefix + '.' if prefix else ''}{f.name}"):
                C.from_dict(cls, {f.name: "no-such-choice"}, prefix)
            with pytest.raises(ValueError, match="expected a string"):
                C.from_dict(cls, {f.name: 3}, prefix)
    assert seen == 14
