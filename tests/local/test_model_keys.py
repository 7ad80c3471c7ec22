"""Architecture keys with ``model.path`` (issue 42, finding 3): a key the config states
(``model.family``, ``model.hidden_size``, ...) is checked against the loaded model's
``config.json`` -- refused by name when they differ, never silently ignored -- and a key
not stated is recorded as none (the model decides) rather than as the tiny model's default."""

import json

import pytest
import yaml

from hapo_openrlhf.config import ModelConfig, load_config
from hapo_openrlhf.local.model import build_model, build_tokenizer, load_or_build, save_hf

from ..conftest import REPO, run_cli

CFG = REPO / "configs" / "cpu_tiny.yaml"
ARCH = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
            max_position_embeddings=128)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("m") / "qwen2"
    tok = build_tokenizer()
    save_hf(build_model(ModelConfig(**ARCH), tok, seed=0), tok, d)
    return d


def test_a_key_that_differs_from_the_loaded_model_is_refused_through_the_cli(qwen2_dir, tmp_path):
    args = ["train", "--config", str(REPO / "configs" / "qwen25_math_7b_hapo.yaml"), "--backend", "local",
            "--output-dir", str(tmp_path / "out"), "--set", f"model.path={qwen2_dir}", "--set", "model.family=llama"]
    res = run_cli(args)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    (err,) = [ln for ln in res.stderr.splitlines() if ln.startswith("hapo: error:")]
    assert "model.family: 'llama' but the model's config.json has model_type: 'qwen2'" in err
    assert "model keys cannot change a saved model" in err
    assert not (tmp_path / "out" / "config.yaml").exists()


@pytest.mark.parametrize("sets, named", [
    (["model.hidden_size=64", "model.num_heads=4"], "model.hidden_size: 64 but the model's config.json has hidden_size: 32"),
    (["model.num_layers=3"], "model.num_layers: 3 but the model's config.json has num_hidden_layers: 1"),
    (["model.tie_word_embeddings=false"], "model.tie_word_embeddings: False"),
    (["model.max_position_embeddings=64"], "model.max_position_embeddings: 64 but the model's config.json has "
                                           "max_position_embeddings: 128"),
])
def test_each_architecture_key_is_checked(qwen2_dir, sets, named):
    cfg = load_config(REPO / "configs" / "qwen25_math_7b_hapo.yaml", [f"model.path={qwen2_dir}", *sets])
    with pytest.raises(ValueError, match="model keys cannot change a saved model") as e:
        load_or_build(cfg.model, seed=0)
    assert named in str(e.value)


def test_keys_that_match_load_and_unstated_keys_are_recorded_as_the_models(qwen2_dir):
    hub = REPO / "configs" / "qwen25_math_7b_hapo.yaml"  # states no architecture key
    cfg = load_config(hub, [f"model.path={qwen2_dir}", "model.family=qwen2", "model.hidden_size=32",
                            "model.num_layers=1"])
    model, _ = load_or_build(cfg.model, seed=0)
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 32
    bare = load_config(hub).to_dict()["model"]
    assert bare["family"] is None and bare["hidden_size"] is None  # not the tiny model's defaults
    with pytest.raises(ValueError, match="model.num_heads: 4 but the model's config.json has num_attention_heads: 2"):
        load_or_build(load_config(hub, [f"model.path={qwen2_dir}", "model.num_heads=4"]).model, seed=0)
    # the tiny model (no path) still gets every default
    tiny = ModelConfig()
    assert (tiny.family, tiny.hidden_size, tiny.tie_word_embeddings) == ("qwen2", 128, True)


def test_an_experiment_variant_cannot_change_the_shared_warm_starts_family(tmp_path):
    from hapo_openrlhf.experiment import load_experiment

    p = tmp_path / "e.yaml"
    p.write_text(yaml.safe_dump({"run_config": str(CFG), "variants": {"a": {"override": {"model": {"family": "llama"}}}},
                                 "suites": {"s": ["a"]}}))
    with pytest.raises(ValueError, match=r"variant 'a' changes \['model.family'\], which the shared warm start"):
        load_experiment(p)


def test_openrlhf_and_megatron_check_the_keys_against_the_model_or_refuse_a_hub_id(qwen2_dir, tmp_path):
    from hapo_openrlhf.integrations.openrlhf.launch.flags import build_argv

    hub = REPO / "configs" / "qwen25_math_7b_hapo.yaml"
    assert "--actor.model_name_or_path" in build_argv(load_config(hub), tmp_path)  # no key stated: as before
    with pytest.raises(ValueError, match="'Qwen/Qwen2.5-Math-7B' is not a local model directory, so model.family "
                                         "cannot be checked"):
        build_argv(load_config(hub, ["model.family=qwen2"]), tmp_path)
    local = [f"model.path={qwen2_dir}"]
    assert build_argv(load_config(hub, [*local, "model.family=qwen2", "model.num_kv_heads=1"]), tmp_path)
    with pytest.raises(ValueError, match="model.family: 'llama' but the model's config.json has model_type: 'qwen2'"):
        build_argv(load_config(hub, [*local, "model.family=llama"]), tmp_path)
    json.loads((qwen2_dir / "config.json").read_text())  # untouched
