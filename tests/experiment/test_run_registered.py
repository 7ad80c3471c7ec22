"""scripts/run_registered.py: a registered experiment goes on from its registered commit, in a git
worktree whose code is checked against the registration, or is refused by name. Run in a shared
clone of this repository (the script's REPO is its own checkout), with this tree's script."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

IDENTITY = ("import json; from hapo_openrlhf.experiment.registration import code_identity; "
            "print(json.dumps(code_identity()))")
ARGS = ["--", "credit", "--config", "configs/experiments/league2.yaml"]


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout")
    d = tmp_path_factory.mktemp("reg") / "repo"
    subprocess.run(["git", "clone", "-q", "--shared", str(REPO), str(d)], check=True)
    shutil.copy(REPO / "scripts" / "run_registered.py", d / "scripts" / "run_registered.py")  # this tree's script
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=d, capture_output=True, text=True, check=True).stdout.strip()
    env = {**os.environ, "PYTHONPATH": str(d)}
    ident = json.loads(subprocess.run([sys.executable, "-c", IDENTITY], cwd=d, env=env, capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1])
    return d, head, ident


def test_the_code_identity_imports_neither_torch_nor_the_runner():
    """The script computes the worktree's code identity in a fresh interpreter: the experiment
    package's names load on first use, so that costs the registration module, not torch (~1.5 s
    a process; issue 57). The package's names still import from it."""
    probe = ("import json, sys; from hapo_openrlhf.experiment.registration import code_identity; code_identity(); "
             "light = sorted(m for m in ('torch', 'transformers', 'hapo_openrlhf.experiment.runner', "
             "'hapo_openrlhf.experiment.report') if m in sys.modules); "
             "from hapo_openrlhf.experiment import load_experiment, run_experiment, Experiment; "
             "import hapo_openrlhf.experiment as e; print(json.dumps([light, 'torch' in sys.modules, "
             "e.run_experiment is run_experiment, callable(load_experiment), hasattr(e, 'no_such_name')]))")
    p = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [[], True, True, True, False]


def _manifest(d, name, code):
    out = d / "runs" / name
    out.mkdir(parents=True, exist_ok=True)
    reg = {"at": "2026-12-06T06:42:28Z", "comparisons": [], "seeds": [1], "settings": {}}
    if code is not None:
        reg["code"] = code
    (out / "experiment.json").write_text(json.dumps({"registration": reg}))
    return f"runs/{name}"


def _run(d, *args):
    return subprocess.run([sys.executable, str(d / "scripts" / "run_registered.py"), *args], cwd=d,
                          capture_output=True, text=True, timeout=300)


def test_the_registered_commit_runs_in_a_checked_worktree_beside_this_checkouts_runs(clone):
    d, head, ident = clone
    code = {k: ident[k] for k in ("sources_sha256", "torch", "transformers")} | {"git_commit": head, "git_dirty": False}
    out = _manifest(d, "ok", code)
    p = _run(d, out, "--dry-run", *ARGS)
    assert p.returncode == 0, p.stderr
    tree = d / ".cache" / "registered" / head
    assert f"{head[:12]} in {tree}" in p.stdout and "the registered code" in p.stdout
    assert f"-m hapo_openrlhf experiment credit --config configs/experiments/league2.yaml --output-dir {out}" in p.stdout
    # the worktree is at the commit, and its runs/ is this checkout's (the manifest's relative paths hold)
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip() == head
    assert (tree / "runs").is_symlink() and (tree / "runs").resolve() == (d / "runs").resolve()
    assert (tree / out / "experiment.json").exists()
    assert _run(d, out, "--dry-run", *ARGS).returncode == 0  # reused as it is
    # without --dry-run the command runs there: hapo experiment's own refusal of a missing file, its exit status
    p = _run(d, out, "--", "credit", "--config", "configs/experiments/no_such.yaml")
    assert p.returncode == 2 and "no_such.yaml" in p.stderr, (p.returncode, p.stderr[-800:])

    # code that differs from the registered (here: the registration's hash) is refused, naming both
    bad = _manifest(d, "other_code", {**code, "sources_sha256": "0" * 64})
    p = _run(d, bad, "--dry-run", *ARGS)
    assert p.returncode == 1 and "(registered -> worktree: " in p.stderr, p.stderr
    assert f"sources_sha256: {'0' * 64} -> {ident['sources_sha256']}" in p.stderr

    # a worktree edited since: refused, never run as the registered code
    f = tree / "hapo_openrlhf" / "__init__.py"
    f.write_text(f.read_text() + "\n# edited\n")
    p = _run(d, out, "--dry-run", *ARGS)
    assert p.returncode == 1 and "has local changes" in p.stderr and "hapo_openrlhf/__init__.py" in p.stderr
    subprocess.run(["git", "checkout", "--", "."], cwd=tree, check=True)
    assert _run(d, out, "--dry-run", *ARGS).returncode == 0


@pytest.mark.parametrize("case, code, message", [
    ("no_registration", None, "has no registration"),
    ("no_commit", {"sources_sha256": "x"}, "records no git commit"),
    ("dirty", {"git_commit": "HEAD", "git_dirty": True}, "registered from a tree with local changes"),
    ("unknown_commit", {"git_commit": "f" * 40, "git_dirty": False}, "is not in this clone: fetch it"),
])
def test_a_registration_that_names_no_clean_commit_here_is_refused(clone, case, code, message):
    d, head, _ = clone
    if code is not None and code.get("git_commit") == "HEAD":
        code = {**code, "git_commit": head}
    out = _manifest(d, case, code)
    if case == "no_registration":
        (d / out / "experiment.json").write_text(json.dumps({"jobs": {}}))
    p = _run(d, out, "--dry-run", *ARGS)
    assert p.returncode == 1 and message in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_bad_arguments_are_one_named_line(clone):
    d, head, _ = clone
    p = _run(d, str(d / "runs" / "ok"), "--dry-run", *ARGS)
    assert p.returncode == 1 and "relative to this checkout" in p.stderr
    p = _run(d, "runs/ok", "--dry-run")
    assert p.returncode == 1 and "nothing to run" in p.stderr
    p = _run(d, "runs/ok", "--dry-run", *ARGS, "--output-dir", "runs/elsewhere")
    assert p.returncode == 1 and "leave --output-dir out" in p.stderr
