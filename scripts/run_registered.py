"""Go on with a registered experiment from the code it was registered with.

    python scripts/run_registered.py OUTPUT_DIR [--dry-run] -- SUITE ... --config FILE [hapo experiment options]

An experiment's registration (``OUTPUT_DIR/experiment.json``) binds its runs to the package's
sources, and the runner refuses another checkout's code by name (or takes ``--code-change``).
Once this checkout has moved on, the registered experiment is run from the registered commit:
this script checks it out into a git worktree (``.cache/registered/COMMIT``, reused while it
stays clean), points the worktree's copy of OUTPUT_DIR's top directory at this checkout's (so
the runs land where they are, under the same relative paths the manifest holds), checks, with
the registered commit's own ``code_difference``, that the worktree's code is the registered
code (its package sources, torch and transformers), and runs
``hapo experiment`` there (``python -m hapo_openrlhf`` with the worktree first on PYTHONPATH).
The report is built from this checkout as usual (``hapo report OUTPUT_DIR --results FILE``).

Refused by name: a manifest without a registration or without a recorded commit, a
registration from a dirty tree (its code is in no commit), a commit this clone does not have,
an absolute OUTPUT_DIR or one outside this checkout, a worktree that is not at that commit or
has local changes, and code that differs from the registered anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# run in the worktree: its code identity, and its own comparison with the registered (read from stdin), so
# "the same code" means what the registered commit's registration.code_difference says it means
IDENTITY = ("import json, sys; from hapo_openrlhf.experiment.registration import code_identity, code_difference; "
            "got = code_identity(); print(json.dumps({'identity': got, "
            "'difference': code_difference(json.load(sys.stdin), got)}))")


def _git(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def registered_code(output_dir: Path) -> dict:
    """The registration's code record, checked to name one clean commit."""
    path = output_dir / "experiment.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"run_registered: cannot read {path}: {e}") from None
    reg = manifest.get("registration") if isinstance(manifest, dict) else None
    if not isinstance(reg, dict):
        raise SystemExit(f"run_registered: {path} has no registration: nothing binds it to a commit; run "
                         f"`hapo experiment` from this checkout")
    code = reg.get("code") if isinstance(reg.get("code"), dict) else {}
    commit = code.get("git_commit")
    if not isinstance(commit, str) or len(commit) != 40 or not all(c in "0123456789abcdef" for c in commit):
        raise SystemExit(f"run_registered: {path}'s registration ({reg.get('at')}) records no git commit (the package "
                         f"was not a git checkout, or it predates the code record): there is no commit to run from")
    if code.get("git_dirty"):
        raise SystemExit(f"run_registered: {path} was registered from a tree with local changes at {commit[:12]}: "
                         f"its code is in no commit; go on from this checkout with `hapo experiment --code-change`")
    return code


def worktree(commit: str) -> Path:
    """``.cache/registered/COMMIT``: added at the commit, or reused when it is there and clean."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise SystemExit(f"run_registered: commit {commit[:12]} is not in this clone: fetch it (git fetch origin "
                         f"{commit}), then run again")
    tree = REPO / ".cache" / "registered" / commit
    if not tree.exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        p = _git("worktree", "add", "--detach", str(tree), commit)
        if p.returncode != 0:
            raise SystemExit(f"run_registered: git worktree add failed: {p.stderr.strip()}")
        return tree
    head = _git("rev-parse", "HEAD", cwd=tree)
    if head.returncode != 0 or head.stdout.strip() != commit:
        raise SystemExit(f"run_registered: {tree} exists but is not a worktree at {commit[:12]}: remove it (git "
                         f"worktree remove --force {tree}) and run again")
    dirty = _git("status", "--porcelain", "--untracked-files=no", cwd=tree)
    if dirty.stdout.strip():
        raise SystemExit(f"run_registered: {tree} has local changes ({dirty.stdout.split(chr(10))[0].strip()} ...): "
                         f"it would not be the registered code; restore it (git -C {tree} checkout -- .)")
    return tree


def link_output(tree: Path, output_dir: Path) -> Path:
    """The worktree's copy of OUTPUT_DIR's top directory, a link to this checkout's."""
    rel = Path(os.path.relpath(output_dir.resolve(), REPO))
    if rel.parts[0] == "..":
        raise SystemExit(f"run_registered: {output_dir} is outside this checkout ({REPO}): the manifest's paths are "
                         f"relative to the directory the experiment ran from; run it from there")
    top, link = REPO / rel.parts[0], tree / rel.parts[0]
    if link.is_symlink():
        if link.resolve() != top.resolve():
            raise SystemExit(f"run_registered: {link} points at {os.readlink(link)}, not {top}: remove it")
    elif link.exists():
        raise SystemExit(f"run_registered: {link} is a directory of the registered commit's own: OUTPUT_DIR must "
                         f"sit in a directory the commit does not track (runs/, for one)")
    else:
        link.symlink_to(top, target_is_directory=True)
    return rel


def check_identity(tree: Path, code: dict, env: dict) -> dict:
    """The worktree's code identity, refused where it differs from the registered."""
    p = subprocess.run([sys.executable, "-c", IDENTITY], cwd=tree, env=env, input=json.dumps(code),
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"run_registered: the worktree's package does not import: {p.stderr.strip()[-800:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if out["difference"]:
        raise SystemExit("run_registered: the worktree is not the registered code (registered -> worktree: "
                         + "; ".join(out["difference"]) + "): the libraries must be the registered versions too")
    return out["identity"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output_dir", type=Path, help="the experiment's output directory (holds experiment.json)")
    ap.add_argument("--dry-run", action="store_true", help="check and prepare, print the command, run nothing")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.output_dir.is_absolute():
        raise SystemExit(f"run_registered: give OUTPUT_DIR relative to this checkout (as the experiment file's "
                         f"output_dir is), got {args.output_dir}")
    if not rest:
        raise SystemExit("run_registered: nothing to run: give hapo experiment's arguments after --, e.g. -- credit "
                         "--config configs/experiments/league2.yaml")
    if any(a == "--output-dir" or a.startswith("--output-dir=") for a in rest):
        raise SystemExit("run_registered: OUTPUT_DIR is the experiment's output directory: leave --output-dir out of "
                         "hapo experiment's arguments")
    code = registered_code(REPO / args.output_dir)
    tree = worktree(code["git_commit"])
    rel = link_output(tree, REPO / args.output_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    got = check_identity(tree, code, env)
    cmd = [sys.executable, "-m", "hapo_openrlhf", "experiment", *rest, "--output-dir", str(rel)]
    print(f"run_registered: {code['git_commit'][:12]} in {tree} (package sources {got['sources_sha256'][:16]}..., "
          f"torch {got.get('torch')}, transformers {got.get('transformers')}: the registered code)")
    print("run_registered: " + " ".join(cmd), flush=True)
    if args.dry_run:
        return 0
    return subprocess.run(cmd, cwd=tree, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
