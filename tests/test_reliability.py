"""No traceback for a user error, anywhere in the CLI: each bad input below goes through
the real `hapo` command in a subprocess and must end with one `hapo: error:` line naming
the key, file or option, a non-zero exit, and no traceback (reliability issue)."""

import json

import pytest

from tests.conftest import REPO, run_cli

CFG = str(REPO / "configs" / "cpu_tiny.yaml")


def _files(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "list.json").write_text(json.dumps([{"problem": "1+1", "answer": "2"}, [1, 2], "x"]))
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    half = tmp_path / "half_model"
    half.mkdir()
    (half / "config.json").write_text("{}")
    return tmp_path


CASES = [
    (["train", "--config", CFG, "--set", "data.eval=`x`"], "--set data.eval"),
    (["train", "--config", CFG, "--set", "model.num_heads=0"], "model.num_heads must be > 0"),
    (["train", "--config", CFG, "--set", "algorithm.estimator_params=5"], "algorithm.estimator_params: expected a mapping"),
    (["train", "--config", "{tmp}/empty.yaml"], "is empty"),
    (["train", "--config", CFG, "--set", "optim.lr=.inf"], "optim.lr must be a finite number"),
    (["train", "--config", CFG, "--set", "optim.lr_warmup_steps=-1"], "optim.lr_warmup_steps must be >= 0"),
    (["train", "--config", CFG, "--set", "output_dir=''"], "output_dir must not be empty"),
    (["train", "--config", CFG, "--set", "data.eval_limit=0"], "data.eval_limit must be >= 1"),
    (["train", "--config", CFG, "--set", "data.eval_limit=-1"], "data.eval_limit must be >= 1"),
    (["train", "--config", CFG, "--set", "model.max_position_embeddings=32"], "model.max_position_embeddings \\(32\\)"),
    (["train", "--config", CFG, "--set", "data.eval={tmp}/list.json", "--set", "warmup.steps=1",
      "--set", "trainer.steps=0"], "list.json: item 2 is a JSON list"),
    (["eval", "--model", "{tmp}/nope/model", "--template", "tiny"], "model directory .*nope/model.* not found"),
    (["eval", "--model", "{tmp}/half_model", "--template", "tiny"], "lacks tokenizer files"),
    (["submit", CFG, "--dry-run", "--cpus-per-task", "0"], "--cpus-per-task must be an integer >= 1"),
    (["submit", CFG, "--dry-run", "--ray-port", "99999"], "--ray-port must be an integer in 1024..65535"),
    (["doctor"], "hapo doctor needs --config"),
]


@pytest.mark.parametrize("args, match", CASES, ids=[" ".join(a[:1] + a[-1:])[:60] for a, _ in CASES])
def test_bad_input_is_one_clear_line(tmp_path, args, match):
    import re

    d = _files(tmp_path)
    args = [a.replace("{tmp}", str(d)) for a in args]
    p = run_cli([*args, "--output-dir", str(d / "out")] if args[0] == "train" else args, cwd=d)
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("hapo: error:")]
    assert len(err) == 1 and re.search(match, err[0]), p.stderr[-2000:]
    assert not (d / "out" / "checkpoints").exists()


def test_unexpected_exceptions_are_one_line_and_verbose_shows_the_traceback(monkeypatch, capsys):
    from hapo_openrlhf import cli

    def boom(args):
        raise KeyError("surprise")

    monkeypatch.setattr(cli, "_list", boom)
    assert cli.main(["list"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "hapo: error: KeyError: 'surprise' (run with -v for the traceback)"
    assert cli.main(["-v", "list"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_full_disk_is_named(monkeypatch, capsys):
    import errno

    from hapo_openrlhf import cli

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/scratch/run/checkpoints/.tmp-step_00000010/shard.pt")

    monkeypatch.setattr(cli, "_list", full)
    assert cli.main(["list"]) == 2
    assert "the disk is full writing /scratch/run/checkpoints/.tmp-step_00000010/shard.pt" in capsys.readouterr().err
