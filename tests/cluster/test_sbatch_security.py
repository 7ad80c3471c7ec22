"""Hostile values never add a command line to a rendered sbatch script (issue: shell
injection through `hapo submit`). Refused values are errors naming the option; values
that are accepted (shell metacharacters inside quoted arguments) leave the script's
command lines exactly those of a benign render: checked with `bash -n`, by comparing the
command lines, and by running the script with the interpreter swapped for `echo`."""

import shlex
import subprocess
import sys

import pytest

from hapo_openrlhf.cluster.sbatch import SubmitOptions, render
from tests.conftest import REPO, run_cli

CFG = REPO / "configs" / "cpu_tiny.yaml"


def command_lines(script: str) -> list[str]:
    """The lines bash executes (comments and #SBATCH directives are not commands)."""
    return [ln for ln in script.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _render(tmp_path, **kw):
    kw.setdefault("output_dir", str(tmp_path / "out"))
    return render(CFG, SubmitOptions(**kw), workdir=tmp_path)


@pytest.mark.parametrize("flag, kw, match", [
    ("--partition", {"partition": "gpu --wrap=touch /tmp/pwned"}, "--partition .* is not a Slurm partition"),
    ("--partition", {"partition": "gpu\nrm -rf ~"}, "--partition .* is not a Slurm partition"),
    ("--account", {"account": "proj\ntouch /tmp/pwned"}, "--account .* is not a Slurm account"),
    ("--output-dir", {"output_dir": "/tmp/x\ntouch /tmp/pwned"}, "--output-dir .* control character"),
    ("--output-dir", {"output_dir": "/tmp/a b"}, "--output-dir .* whitespace"),
    ("--output-dir", {"output_dir": "/tmp/run_%j"}, "--output-dir .* '%'"),
    ("--sbatch", {"extra_sbatch": ("--qos=high\ntouch /tmp/pwned",)}, "--sbatch .* control character"),
    ("--sbatch", {"extra_sbatch": ("--qos=high --wrap=id",)}, "--sbatch .* must be one option"),
    ("--sbatch", {"extra_sbatch": ("touch /tmp/pwned",)}, "--sbatch .* must be one option"),
    ("--sbatch", {"extra_sbatch": ("--wrap=id",)}, "--wrap is set by hapo submit"),
    ("--sbatch", {"extra_sbatch": ("--output=/etc/x",)}, "--output is set by hapo submit"),
    # getopt_long abbreviations that sbatch reads as the script's own options
    ("--sbatch", {"extra_sbatch": ("--outp=/etc/x",)}, "--outp abbreviates --output, which is set by hapo submit"),
    ("--sbatch", {"extra_sbatch": ("--sig=B:USR1@1",)}, "--sig abbreviates --signal"),
    ("--sbatch", {"extra_sbatch": ("--no-requeu",)}, "--no-requeu abbreviates --no-requeue"),
    ("--sbatch", {"extra_sbatch": ("--job-n=x",)}, "--job-n abbreviates --job-name"),
    ("--sbatch", {"extra_sbatch": ("--part=debug",)}, "--part abbreviates --partition"),
    ("--sbatch", {"extra_sbatch": ("--chd=/",)}, "--chd abbreviates --chdir"),
    ("--set", {"sets": ("seed=1\ntouch /tmp/pwned",)}, "--set .* control character"),
    ("--time", {"time": "1:00:00\ntouch /tmp/pwned"}, "--time .* is not a Slurm time"),
    ("--time", {"time": "\u0663\u0660:00:00"}, "--time .* is not a Slurm time"),  # Arabic-Indic digits
    ("--time", {"time": "00:04:00"}, "the config's signal lead .* is 300 s, which does not fit in --time 00:04:00"),
    ("--time", {"time": "10", "signal_seconds": 900}, "--signal-seconds is 900 s, which does not fit in --time 10 "),
    ("--cpus-per-task", {"cpus_per_task": 0}, "--cpus-per-task must be an integer >= 1, got 0"),
    ("--cpus-per-task", {"cpus_per_task": -1}, "--cpus-per-task must be an integer >= 1"),
    ("--max-requeues", {"max_requeues": -5}, "--max-requeues must be an integer >= 0"),
    ("--ray-port", {"ray_port": 99999}, "--ray-port must be an integer in 1024..65535"),
    ("--nodes", {"nodes": 0}, "--nodes must be"),
    ("--signal-seconds", {"signal_seconds": 70000}, "--signal-seconds must be an integer in 1..65535"),
    ("--network-interface", {"network_interface": "ib0; id"}, "--network-interface .* is not a network interface"),
])
def test_hostile_values_are_refused_naming_the_option(tmp_path, flag, kw, match):
    with pytest.raises(ValueError, match=match):
        _render(tmp_path, **kw)


@pytest.mark.parametrize("directive", ["--gpus=8", "--qos=high", "--time-min=30", "--mem=64G", "--exclusive"])
def test_sbatch_options_that_only_look_like_own_ones_pass(tmp_path, directive):
    """An exact sbatch option is never taken for an abbreviation (--gpus is not
    --gpus-per-node, --time-min is not --time)."""
    assert f"#SBATCH {directive}" in _render(tmp_path, extra_sbatch=(directive,))


def test_a_set_value_that_is_not_yaml_is_named(tmp_path):
    with pytest.raises(ValueError, match="--set data.eval: '`x`' is not a YAML value"):
        _render(tmp_path, sets=("data.eval=`x`",))


def test_hostile_run_name_from_a_shared_config_is_refused(tmp_path):
    cfg = tmp_path / "evil.yaml"
    cfg.write_text(f"base: {CFG}\nrun_name: \"x\\ntouch /tmp/pwned\"\n")
    with pytest.raises(ValueError, match="run_name must be one non-empty line"):
        render(cfg, SubmitOptions(output_dir=str(tmp_path / "o")), workdir=tmp_path)
    spaced = tmp_path / "spaced.yaml"
    spaced.write_text(f"base: {CFG}\nrun_name: \"x --wrap=id\"\n")
    with pytest.raises(ValueError, match="run_name 'x --wrap=id' cannot be a Slurm job name"):
        render(spaced, SubmitOptions(output_dir=str(tmp_path / "o")), workdir=tmp_path)
    p = run_cli(["submit", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "o")])
    assert p.returncode == 2 and "run_name" in p.stderr and "Traceback" not in p.stderr


def test_accepted_metacharacters_stay_inside_their_arguments(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    benign = _render(tmp_path, sets=("seed=1",), output_dir=str(tmp_path / "out"))
    hostile_sets = (f"data.train=$(touch {marker})", f"data.eval=\"`touch {marker}`;touch {marker}\"",
                    f"output_dir='; touch {marker}; '")
    hostile = _render(tmp_path, sets=hostile_sets, output_dir=str(tmp_path / "out;x&&y|z"),
                      extra_sbatch=("--qos=high;touch", "--comment=$(touch)"))
    # same command lines, apart from the exec line's (quoted) arguments
    b, h = command_lines(benign), command_lines(hostile)
    assert len(b) == len(h) == 3 and b[:2] == h[:2]
    assert subprocess.run(["bash", "-n"], input=hostile, text=True).returncode == 0
    argv = shlex.split(h[2])
    assert argv[0] == "exec" and argv[argv.index("--output-dir") + 1] == str(tmp_path / "out;x&&y|z")
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--set"][:3] == list(hostile_sets)
    # run it: with the interpreter replaced by echo, the script only prints its arguments
    monkeypatch.setattr(sys, "executable", "/bin/echo")
    script = _render(tmp_path, sets=hostile_sets, output_dir=str(tmp_path / "out;x&&y|z"))
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert not marker.exists() and f"data.train=$(touch {marker})" in p.stdout
