"""``hapo extend-context``: a model directory with YaRN in its config.json, as Qwen's model cards
ask for 131,072 positions (the 128k context-parallel config's model): the weights linked, not
copied; transformers and the Megatron actor's family check read the YaRN settings back; what
cannot be extended is refused by name, and nothing is written then."""

import json

import pytest
import torch

from tests.conftest import cli_in_process, run_cli


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config

    d = tmp_path_factory.mktemp("qwen3")
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def test_extend_context_writes_yarn_and_links_the_weights(tiny_qwen3, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from hapo_openrlhf.megatron.families import yarn_settings

    out = tmp_path / "yarn4"
    p = run_cli(["extend-context", str(tiny_qwen3), str(out), "--factor", "4"], fresh=True)  # a fresh interpreter
    assert p.returncode == 0, p.stderr
    assert "YaRN x4" in p.stdout
    raw = json.loads((out / "config.json").read_text())
    assert raw["rope_scaling"]["rope_type"] == "yarn" and raw["rope_scaling"]["factor"] == 4.0
    assert raw["rope_scaling"]["original_max_position_embeddings"] == 32 and raw["max_position_embeddings"] == 32
    weights = out / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (tiny_qwen3 / "model.safetensors").resolve()
    assert json.loads((tiny_qwen3 / "config.json").read_text()).get("rope_scaling") is None  # the source untouched
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    src = AutoModelForCausalLM.from_pretrained(tiny_qwen3)
    assert all(torch.equal(a, b) for a, b in zip(hf.state_dict().values(), src.state_dict().values()))
    got = yarn_settings(AutoConfig.from_pretrained(out))
    assert got["yarn_rotary_scaling_factor"] == 4.0 and got["yarn_original_max_position_embeddings"] == 32


@pytest.mark.parametrize("case, args, problem", [
    ("factor", ["--factor", "1"], "--factor must be a number > 1"),
    ("factor_nan", ["--factor", "nan"], "--factor must be a number > 1"),
    ("original", ["--factor", "4", "--original", "0"], "--original must be the model's pretraining context"),
    ("scaled", ["--factor", "2"], "already scales RoPE ('yarn')"),
    ("not_empty", ["--factor", "4"], "exists and is not an empty directory"),
    ("missing", ["--factor", "4"], "not a local model directory and not in the local Hugging Face cache"),
])
def test_extend_context_refuses_by_name(tiny_qwen3, tmp_path, case, args, problem):
    src = str(tiny_qwen3)
    out = tmp_path / "out"
    if case == "scaled":
        assert cli_in_process(["extend-context", src, str(tmp_path / "once"), "--factor", "4"]).returncode == 0
        src = str(tmp_path / "once")
    if case == "not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    if case == "missing":
        src = "no-such-org/no-such-model"
    p = cli_in_process(["extend-context", src, str(out), *args])
    assert p.returncode == 2 and problem in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1  # one line
    if case == "not_empty":
        assert sorted(x.name for x in out.iterdir()) == ["keep.txt"]
    else:
        assert not out.exists()
