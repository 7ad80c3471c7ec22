"""No traceback for a user error, anywhere in the CLI: each bad input below goes through
the real `hapo` command (in this process; one case of each command in a subprocess) and must end with one `hapo: error:` line naming
the key, file or option, a non-zero exit, and no traceback (reliability issue)."""

import functools
import json
import os
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_in_process, run_cli

CFG = str(REPO / "configs" / "cpu_tiny.yaml")


def _files(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "list.json").write_text(json.dumps([{"problem": "1+1", "answer": "2"}, [1, 2], "x"]))
    (tmp_path / "data.parquet").write_bytes(b"PAR1")
    (tmp_path / "huge.jsonl").write_text(json.dumps({"problem": "1+" * 500_000 + "1", "answer": "500001"}) + "\n")
    half = tmp_path / "half_model"
    half.mkdir()
    (half / "config.json").write_text("{}")
    trunc = tmp_path / "truncated_model"  # weights cut off mid-copy
    trunc.mkdir()
    (trunc / "config.json").write_text("{}")
    (trunc / "tokenizer.json").write_text("{}")
    (trunc / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"w\"")
    for name, text in (("badcfg_model", "{torn"), ("hint_model", "{}")):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(text)
        (d / "tokenizer.json").write_text("{}")
    (tmp_path / "hint_model" / "hapo.json").write_text("[1, 2")
    (tmp_path / "devzero.yaml").write_text("base: /dev/zero\n")
    (tmp_path / "latin1.yaml").write_bytes(b"base: " + CFG.encode() + b"\nrun_name: caf\xe9\n")
    run = tmp_path / "run_bad_step"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": "x"}\n{"step": 3}\n')
    # issue 55: a final evaluation record with a string accuracy; a summary with a string value; a FIFO log
    run = tmp_path / "run_str_accuracy"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n'
                                       '{"step": 2, "eval/accuracy": "high", "eval/response_len": 9.0}\n')
    run = tmp_path / "run_str_summary"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    (run / "summary.json").write_text(json.dumps({"before": {"eval/accuracy": 0.1},
                                                  "after": {"eval/accuracy": 0.2, "eval/response_len": "long"}}))
    # issue 55: hostile config.json values, named before anything is allocated from them
    real = json.loads((REPO / "hapo_openrlhf/megatron/model_configs/qwen3-30b-a3b-base.json").read_text())
    for name, change in (("dtype_model", {"torch_dtype": "float1024"}), ("neg_model", {"hidden_size": -96}),
                         ("noheads_model", {"num_attention_heads": 0}), ("experts_model", {"num_experts": 10**6})):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**real, **change}))
        (d / "tokenizer.json").write_text("{}")
    run = tmp_path / "run_fifo_log"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")
    return tmp_path


CASES = [
    (["train", "--config", CFG, "--set", "data.eval=`x`"], "--set data.eval"),
    (["train", "--config", CFG, "--set", "model.num_heads=0"], "model.num_heads must be > 0"),
    (["train", "--config", CFG, "--set", "algorithm.estimator_params=5"], "algorithm.estimator_params: expected a mapping"),
    (["train", "--config", "{tmp}/empty.yaml"], "is empty"),
    (["train", "--config", CFG, "--set", "optim.lr=.inf"], "optim.lr: expected a finite number, got inf"),
    (["train", "--config", CFG, "--set", "optim.lr_warmup_steps=-1"], "optim.lr_warmup_steps must be >= 0"),
    (["train", "--config", CFG, "--set", "output_dir=''"], "output_dir must not be empty"),
    (["train", "--config", CFG, "--set", "data.eval_limit=0"], "data.eval_limit must be >= 1"),
    (["train", "--config", CFG, "--set", "data.eval_limit=-1"], "data.eval_limit must be >= 1"),
    (["train", "--config", CFG, "--set", "model.max_position_embeddings=32"], "model.max_position_embeddings \\(32\\)"),
    (["train", "--config", CFG, "--set", "data.eval={tmp}/list.json", "--set", "warmup.steps=1",
      "--set", "trainer.steps=0"], "list.json: item 2 is a JSON list"),
    (["train", "--config", CFG, "--set", "data.train={tmp}/huge.jsonl", "--set", "data.eval={tmp}/huge.jsonl",
      "--set", "warmup.steps=0", "--set", "eval.n_samples=1"], "prompt 0 .* has 1000\\d+ tokens"),
    (["eval", "--model", "{tmp}/nope/model", "--template", "tiny"], "model directory .*nope/model.* not found"),
    (["eval", "--model", "{tmp}/half_model", "--template", "tiny"], "lacks tokenizer files"),
    (["submit", CFG, "--dry-run", "--cpus-per-task", "0"], "--cpus-per-task must be an integer >= 1"),
    (["submit", CFG, "--dry-run", "--ray-port", "99999"], "--ray-port must be an integer in 1024..65535"),
    (["doctor"], "hapo doctor needs --config"),
    (["doctor", "--config", CFG, "--gpu-gb", "nan"], "--gpu-gb must be a positive number of GB"),
    (["doctor", "--config", CFG, "--gpu-gb", "-3"], "--gpu-gb must be a positive number of GB .*got -3.0"),
    # hostile values that used to reach an internal exception (TypeError, OverflowError, ...)
    (["train", "--config", CFG, "--set", "trainer.threads=-1"], "trainer.threads must be >= 0"),
    (["train", "--config", CFG, "--set", "trainer.sample_every=-1"], "trainer.sample_every must be >= 0"),
    (["train", "--config", CFG, "--set", "trainer.sample_count=-3"], "trainer.sample_count must be >= 0"),
    (["train", "--config", CFG, "--set", "algorithm.estimator_params={alpha: [0.2], phi: 2.0}"],
     "hapo'?: alpha must be a finite number, got \\(0.2,\\)"),
    (["train", "--config", CFG, "--set", "algorithm.estimator_params={alpha: 0.2, phi: 2.0, eps: -1}"],
     "eps must be > 0"),
    # a string that is no number (one that is, '2' or 1e-3, reads as the number, as typed keys do: issue 55)
    (["train", "--config", CFG, "--set", "algorithm.estimator_params={alpha: 0.2, phi: 'two'}"],
     "phi must be a finite number, got 'two'"),
    (["train", "--config", CFG, "--set", "algorithm.estimator_params={alpha: .nan, phi: 2.0}"],
     "alpha must be a finite number, got nan"),
    (["train", "--config", CFG, "--set", "warmup.lr=.inf"], "warmup.lr: expected a finite number, got inf"),
    (["train", "--config", CFG, "--set", "rollout.top_p=[0.9]"], "rollout.top_p: expected a number"),
    (["train", "--config", CFG, "--set", "algorithm.estimator_params={a: &x [1, 2], b: *x}"],
     "YAML aliases \\(\\*x\\) are not allowed"),
    (["submit", CFG, "--dry-run", "--set", "slurm.expected_step_s=.inf"], "slurm.expected_step_s: expected a finite"),
    (["doctor", "--config", CFG, "--set", "slurm.expected_step_s=.inf"], "slurm.expected_step_s: expected a finite"),
    (["submit", CFG, "--dry-run", "--set", "slurm.signal_lead_s=99999"], "slurm.signal_lead_s must be in 30..65535"),
    (["submit", CFG, "--dry-run", "--time", "00:04:00"], "signal lead .* 300 s, which does not fit in --time"),
    (["submit", CFG, "--dry-run", "--array", "seeds=1,1"], "repeats seed\\(s\\) \\[1\\]"),
    (["eval", "--model", "{tmp}/truncated_model", "--template", "tiny"], "model.safetensors is incomplete or corrupt"),
    (["eval", "--model", "{tmp}/badcfg_model", "--template", "tiny"], "config.json .* is unreadable or not JSON"),
    (["eval", "--model", "{tmp}/hint_model"], "hapo.json .* is unreadable or not JSON"),
    (["report", "{tmp}/run_bad_step"], "metrics.jsonl:2: corrupt line \\('step' must be an integer"),
    (["eval", "--model", "{tmp}/dtype_model", "--template", "tiny"],
     "dtype_model/config.json: torch_dtype must be one of .*, got 'float1024'"),
    (["eval", "--model", "{tmp}/neg_model", "--template", "tiny"],
     "neg_model/config.json: hidden_size must be a positive integer, got -96"),
    (["eval", "--model", "{tmp}/noheads_model", "--template", "tiny"],
     "noheads_model/config.json: num_attention_heads must be a positive integer, got 0"),
    (["eval", "--model", "{tmp}/experts_model", "--template", "tiny", "--engine", "hf"],
     "experts_model/config.json: the model it describes has 226592.25B parameters, .* GiB in fp32, more than"),
    (["report", "{tmp}/run_str_accuracy"], "run_str_accuracy/metrics.jsonl, the evaluation record of step 2: "
                                           "eval/accuracy must be a number, got 'high'"),
    (["report", "{tmp}/run_str_summary"], "run_str_summary/summary.json: after.eval/response_len must be a number, "
                                          "got 'long'"),
    (["report", "{tmp}/run_fifo_log"], "run_fifo_log/metrics.jsonl \\(a run's metrics log\\) is a FIFO, not a "
                                       "regular file"),
    # sizes checked at load, before any allocation or draw (issue 42)
    (["train", "--config", CFG, "--set", "data.synthetic.eval_size=1000000000000"],
     "data.synthetic.eval_size must be in \\[1, 1000000\\], got 1000000000000"),
    (["train", "--config", CFG, "--set", "data.synthetic.eval_size=100000"],
     "data.synthetic.eval_size \\(100000\\) is more than 95% of the ~291 distinct held-out problems"),
    (["train", "--config", CFG, "--set", "eval.n_samples=1000000000"], "eval.n_samples must be in \\[1, 4096\\]"),
    (["train", "--config", CFG, "--set", "eval.max_new_tokens=0"], "eval.max_new_tokens must be in \\[1, "),
    (["train", "--config", "{tmp}/devzero.yaml"], "/dev/zero \\(config file\\) is a device, not a regular file"),
    (["train", "--config", "{tmp}/latin1.yaml"], "latin1.yaml \\(config file\\) is not UTF-8 text"),
]


# one case of each command also runs through the installed entry point in a fresh interpreter
# (the exit code a shell sees, nothing printed before the error line by an import); the table
# runs in this process (cli.main), where the subject -- the parser's and the loader's answer -- is
# the same and a case costs no torch import (issue 57)
ENTRY_POINT_CASES = [next(c for c in CASES if c[0][0] == cmd) for cmd in ("train", "eval", "submit", "doctor", "report")]


@pytest.mark.parametrize("args, match", CASES, ids=[" ".join(a[:1] + a[-1:])[:60] for a, _ in CASES])
def test_bad_input_is_one_clear_line(tmp_path, args, match):
    _check_one_clear_line(tmp_path, args, match, cli_in_process)


@pytest.mark.parametrize("args, match", ENTRY_POINT_CASES, ids=[a[0] for a, _ in ENTRY_POINT_CASES])
def test_bad_input_is_one_clear_line_through_the_entry_point(tmp_path, args, match):
    _check_one_clear_line(tmp_path, args, match, functools.partial(run_cli, fresh=True))  # a fresh interpreter


def _check_one_clear_line(tmp_path, args, match, run):
    import re

    d = _files(tmp_path)
    args = [a.replace("{tmp}", str(d)) for a in args]
    p = run([*args, "--output-dir", str(d / "out")] if args[0] in ("train", "report") else args, cwd=d)
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("hapo: error:")]
    assert len(err) == 1 and re.search(match, err[0]), p.stderr[-2000:]
    assert not re.search(r"\b[A-Z]\w*(Error|Exception)\b", err[0]), err[0]  # names the input, not a Python class
    assert not (d / "out" / "checkpoints").exists()


def test_a_base_chain_thousands_of_files_deep_is_one_named_line(tmp_path):
    for i in range(3000):
        (tmp_path / f"c{i}.yaml").write_text(f"base: c{i + 1}.yaml\n")
    p = run_cli(["train", "--config", str(tmp_path / "c0.yaml")], cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "RecursionError" not in p.stderr
    assert "its base: chain is more than 32 files deep" in p.stderr


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


# ---------------------------------------------------------------- faults on disk
SMALL = ["warmup.steps=40", "data.synthetic.eval_size=8", "rollout.prompts_per_step=4", "trainer.save_every=2",
         "trainer.keep_last=3", "trainer.eval_every=0", "trainer.sample_every=0", "eval.n_samples=1"]


def _train(out, *extra, resume=False, wait=True, in_process=False):
    """``hapo train`` on the small embedded config: a subprocess of the entry point, or with
    ``in_process`` ``cli.main`` in this process (no interpreter start and imports per run, issue 57)."""
    import subprocess
    import sys

    args = ["train", "--config", CFG, "--output-dir", str(out), *(["--resume"] if resume else [])]
    for kv in [*SMALL, *extra]:
        args += ["--set", kv]
    if not wait:
        return subprocess.Popen([sys.executable, "-m", "hapo_openrlhf", *args], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return cli_in_process(args) if in_process else run_cli(args)


def _steps(out):
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


@pytest.mark.slow
def test_corrupt_newest_checkpoint_garbage_latest_and_torn_metrics_still_resume(tmp_path):
    # four runs of cli.main in this process: what is checked is the resume's choice of checkpoint and
    # its messages, the same in or out of a fresh interpreter (the subprocess resumes: test_trainer.py)
    ref = tmp_path / "ref"
    assert _train(ref, "trainer.steps=6", in_process=True).returncode == 0
    out = tmp_path / "run"
    assert _train(out, "trainer.steps=4", in_process=True).returncode == 0
    ck = out / "checkpoints"
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == \
        ["step_00000000", "step_00000002", "step_00000004"]
    shard = ck / "step_00000004" / "shard_rank00000.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated newest shard
    (ck / "latest").write_bytes(b"\xff\xfe garbage \x00")  # the pointer is advisory
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "reward/me')  # torn last line (a full disk mid-write)
    p = _train(out, "trainer.steps=6", resume=True, in_process=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "skipping checkpoint" in p.stderr and "step_00000004" in p.stderr and "truncated" in p.stderr
    assert "resumed from" in p.stderr and "(step 2)" in p.stderr
    assert "torn last line" in p.stderr and "Traceback" not in p.stderr
    assert _steps(out) == _steps(ref)  # == an uninterrupted run: resumed from the newest verified state

    # nothing verifies: an error listing what was tried, nothing overwritten
    for d in ck.iterdir():
        if d.name.startswith("step_"):
            s = d / "shard_rank00000.pt"
            s.write_bytes(b"x" + s.read_bytes()[1:])
    p = _train(out, "trainer.steps=8", resume=True, in_process=True)
    assert p.returncode == 2 and "no checkpoint under" in p.stderr and "CRC-32" in p.stderr, p.stderr[-2000:]
    assert p.stderr.count("step_0000000") >= 3 and "Traceback" not in p.stderr


@pytest.mark.slow
def test_a_second_process_on_a_busy_run_directory_is_refused(tmp_path):
    import time

    out = tmp_path / "run"
    first = _train(out, "trainer.steps=30", "warmup.steps=200", wait=False)
    try:
        lock = out / ".hapo.lock"
        t0 = time.time()
        while not (lock.exists() and lock.read_text().strip()):
            assert time.time() - t0 < 60 and first.poll() is None, first.stderr.read() if first.poll() else ""
            time.sleep(0.1)
        for resume in (False, True):
            p = _train(out, "trainer.steps=30", resume=resume)
            assert p.returncode == 2, p.stderr[-2000:]
            assert f"is in use by PID {first.pid}" in p.stderr and "Traceback" not in p.stderr
    finally:
        first.kill()
        first.wait()
    # the kernel dropped the killed holder's lock: a resume may take the directory now
    from hapo_openrlhf.rundir import runlock

    runlock.acquire(out)
    runlock.release(out)


def test_final_model_is_written_atomically(tmp_path, monkeypatch):
    """A kill while the final model is written leaves the old directory (or none), never
    weights without a tokenizer."""
    from hapo_openrlhf.local.model import build_tokenizer, save_hf

    class Model:
        def save_pretrained(self, d):
            Path(d, "model.safetensors").write_text("w")

    tok = build_tokenizer()
    save_hf(Model(), tok, tmp_path / "final_model", extra_files={"hapo.json": "{}"})
    before = sorted(p.name for p in (tmp_path / "final_model").iterdir())
    assert "model.safetensors" in before and "hapo.json" in before and any("tokenizer" in n for n in before)

    def killed(*a, **k):
        raise KeyboardInterrupt  # the process dies while the tokenizer is being written

    monkeypatch.setattr(type(tok), "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        save_hf(Model(), tok, tmp_path / "final_model")
    assert sorted(p.name for p in (tmp_path / "final_model").iterdir()) == before


@pytest.mark.parametrize("plant", ["symlink", "fifo", "directory"])
def test_a_planted_lock_file_is_refused_not_followed(tmp_path, plant):
    """A symlink at OUTPUT_DIR/.hapo.lock would make the run truncate whatever it points
    at; a FIFO would block it. Each is refused by name, and the target is untouched."""
    import os

    out, victim = tmp_path / "run", tmp_path / "victim.txt"
    out.mkdir()
    victim.write_text("precious")
    lock = out / ".hapo.lock"
    {"symlink": lambda: lock.symlink_to(victim), "fifo": lambda: os.mkfifo(lock),
     "directory": lambda: lock.mkdir()}[plant]()
    p = run_cli(["train", "--config", CFG, "--output-dir", str(out), "--set", "trainer.steps=0"])
    assert p.returncode == 2, p.stderr[-2000:]
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("hapo: error:")]
    assert len(err) == 1 and ".hapo.lock" in err[0] and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert {"symlink": "symbolic link", "fifo": "not a regular file", "directory": "is a directory"}[plant] in err[0]
    assert victim.read_text() == "precious"


@pytest.mark.slow
def test_resume_applies_an_optimizer_override(tmp_path):
    """--resume --set optim.lr=... trains at the new rate (the checkpoint's param groups and
    scheduler held the old one), and says the changed key is applied."""
    out = tmp_path / "run"
    assert _train(out, "trainer.steps=2").returncode == 0
    p = _train(out, "trainer.steps=3", "optim.lr=0.01", "optim.weight_decay=0.5", resume=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "changed config (applied from here on)" in p.stderr and "optim.lr: 0.0001 -> 0.01" in p.stderr
    rows = [r for r in (json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()) if "actor/lr" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]  # training rows (evaluation rows carry no lr)
    assert rows[1]["actor/lr"] == pytest.approx(1e-4) and rows[2]["actor/lr"] == pytest.approx(0.01)


def test_an_empty_training_file_under_a_4_gib_address_space_limit_is_named(tmp_path):
    """No MemoryError and no traceback: the empty file is named before the model is built."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    (tmp_path / "empty.jsonl").write_text("")
    p = run_cli(["train", "--config", CFG, "--output-dir", str(tmp_path / "out"), "--set",
                 f"data.train={tmp_path / 'empty.jsonl'}", "--set", "warmup.steps=0"], cwd=tmp_path, preexec_fn=limit)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "MemoryError" not in p.stderr
    (err,) = [ln for ln in p.stderr.splitlines() if ln.startswith("hapo: error:")]
    assert "empty.jsonl' yielded no usable problems" in err, err
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_user_chosen_save_path_is_replaced_only_when_hapo_wrote_it(tmp_path):
    """fsguard.remove_owned (the Megatron actor's Hugging Face saves, whose directory comes
    from OpenRLHF's --save_path / --ckpt.path): a marked directory or a bare model save is
    replaced; a directory with anything else, a link or a file is a named error and intact."""
    from hapo_openrlhf.rundir.fsguard import claim, remove_owned

    marked, model, home, victim = (tmp_path / n for n in ("marked", "model", "home", "victim"))
    for d in (marked, model, home, victim):
        d.mkdir()
    claim(marked)
    (marked / "notes.txt").write_text("ours")
    for f in ("config.json", "model-00001-of-00002.safetensors", "tokenizer.json", "generation_config.json"):
        (model / f).write_text("{}")
    (home / "config.json").write_text("{}")
    (home / "thesis.tex").write_text("precious")
    (victim / "precious.txt").write_text("precious")
    link = tmp_path / "link"
    link.symlink_to(victim, target_is_directory=True)
    remove_owned(tmp_path / "absent", "x")
    remove_owned(marked, "x")
    remove_owned(model, "x", check_only=True)
    assert model.exists()
    remove_owned(model, "x")
    assert not marked.exists() and not model.exists()
    with pytest.raises(ValueError, match=r"home exists and holds files hapo did not write"):
        remove_owned(home, "the Hugging Face save's directory", check_only=True)
    with pytest.raises(ValueError, match="is a symbolic link; refusing to replace it"):
        remove_owned(link, "x")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        remove_owned(tmp_path / "file", "x")
    assert (home / "thesis.tex").read_text() == "precious" and (victim / "precious.txt").read_text() == "precious"
