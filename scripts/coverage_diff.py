"""Line coverage of ``hapo_openrlhf/`` by some tests at a commit, subprocesses included, and the
lines one commit's run covers that another's does not (issue 57: a suite made faster must cover no
less). Each run is in a throw-away ``git worktree`` of its commit, the tests importing it through
PYTHONPATH, as scripts/breakages.py does.

    python scripts/coverage_diff.py --rev A --rev B [--workers N] [-- PYTEST ARGS...]

Every Python process the tests start -- CLI runs, the OpenRLHF e2e drivers, their Ray actors (with
the vLLM venv, which layers this environment's site directory), fork-server ranks -- starts
coverage.py through ``coverage.process_startup()``: a ``.pth`` file put in this environment's
site-packages for the run and removed after, acting only where ``COVERAGE_PROCESS_START`` is set.
Data is written at exit, on SIGTERM and before ``os._exit`` (``[run] sigterm``, ``patch = _exit``);
a process killed with SIGKILL writes none (Ray's workers at shutdown can be), so the figures are a
lower bound -- alike for both commits. Files are matched by their path inside the package. A process
that ran the package from another checkout (the editable install's) is named in the output: its lines
are that checkout's, so the comparison is exact only where none is named or both commits' package code
equals that checkout's. (Ray's helper processes, whose PYTHONPATH is Ray's own, find the package
through the editable install and import none of it: coverage.py lists those files with no line run,
which is not such a process.) Prints, per commit, the covered lines and statements, then
the lines covered by the first commit's run and not the second's (file:line), and a JSON line last.
Lines are matched across the two commits by content (``difflib`` over each file's two versions), so
lines the second commit inserted do not shift the rest into false losses; a covered line the second
commit edited or removed is listed apart, as changed, not as lost. Exit 1 when a line the second
commit left alone is covered by the first run and not the second.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PTH = "_hapo_coverage_startup.pth"


def covered(rev: str, workers: int, pytest_args: list[str]) -> tuple[dict[str, set[int]], int, dict]:
    """{relative file: covered line numbers}, statement count and the pytest summary at ``rev``."""
    tmp = Path(tempfile.mkdtemp(prefix="hapo-cov-"))
    tree, data = tmp / "tree", tmp / "data"
    data.mkdir()
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), rev], check=True)
    rc = tmp / "coveragerc"
    rc.write_text(f"[run]\nparallel = True\nsigterm = True\npatch = _exit\nsource_pkgs = hapo_openrlhf\n"
                  f"data_file = {data / '.coverage'}\n")
    pth = Path(site.getsitepackages()[0]) / PTH
    try:
        pth.write_text("import coverage; coverage.process_startup()\n")
        env = {**os.environ, "PYTHONPATH": str(tree), "COVERAGE_PROCESS_START": str(rc)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               *(["-n", str(workers)] if workers > 1 else []), *pytest_args]
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        summary = (p.stdout.strip().splitlines() or [""])[-1]
    finally:
        pth.unlink(missing_ok=True)
    try:
        subprocess.run([sys.executable, "-m", "coverage", "combine", "-q", f"--rcfile={rc}"], cwd=tree, check=True)
        report = tmp / "coverage.json"
        subprocess.run([sys.executable, "-m", "coverage", "json", "-q", f"--rcfile={rc}", "-o", str(report)],
                       cwd=tree, check=True)
        files = json.loads(report.read_text())["files"]
        lines: dict[str, set[int]] = {}
        statements, elsewhere = {}, set()
        for f, v in files.items():
            root, inside = str(Path(f).resolve()).split("/hapo_openrlhf/", 1)
            # a process that ran the package from another checkout (a file of it listed with no line
            # run is coverage.py reporting a source package a process found but never imported)
            if Path(root) != tree and v["executed_lines"]:
                elsewhere.add(root)
            rel = "hapo_openrlhf/" + inside
            lines.setdefault(rel, set()).update(v["executed_lines"])
            statements[rel] = v["summary"]["num_statements"]
        return lines, sum(statements.values()), {"rev": rev, "returncode": p.returncode, "summary": summary,
                                                 "other_roots": sorted(elsewhere)}
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", action="append", required=True, help="twice: the commit before, then after")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args()
    if len(a.rev) != 2:
        ap.error("--rev twice: the commit before, then the one after")
    for rev in a.rev:  # a commit, resolved before any worktree (a value like "--x" is refused, not run by git)
        ok = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", "--end-of-options",
                             f"{rev}^{{commit}}"], capture_output=True, text=True)
        if ok.returncode != 0:
            ap.error(f"--rev {rev!r}: not a commit of this repository")
    try:
        import coverage  # noqa: F401
    except ImportError:
        ap.error("needs coverage.py in this environment: python -m pip install coverage")
    runs = [covered(rev, a.workers, a.pytest_args or ["tests"]) for rev in a.rev]
    out = []
    for lines, statements, info in runs:
        n = sum(len(v) for v in lines.values())
        print(f"{info['rev']}: {n} lines of hapo_openrlhf/ covered of {statements} statements "
              f"({100 * n / max(statements, 1):.2f}%); pytest: {info['summary']}")
        if info["other_roots"]:
            print(f"{info['rev']}: some processes ran hapo_openrlhf from {info['other_roots']}, not the "
                  "worktree (counted by path inside the package)")
        out.append({**info, "covered": n, "statements": statements})
    (before, _, _), (after, _, _) = runs
    maps = {f: map_lines(_show(a.rev[0], f), _show(a.rev[1], f)) for f in set(before) | set(after)}
    lost, gained, changed = compare(before, after, maps)
    for x in lost:
        print(f"covered at {a.rev[0]} only: {x}")
    if changed:
        print(f"{len(changed)} lines covered at {a.rev[0]} are lines {a.rev[1]} changed or removed (not compared): "
              + ", ".join(changed))
    print(json.dumps({"runs": out, "lost": lost, "gained": len(gained), "changed": changed}))
    return 1 if lost or any(r["returncode"] != 0 for r in out) else 0


def _show(rev: str, rel: str) -> str:
    """``rel``'s text at ``rev`` ('' where the commit has no such file)."""
    p = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{rel}"], capture_output=True, text=True)
    return p.stdout if p.returncode == 0 else ""


def map_lines(old: str, new: str) -> dict[int, int]:
    """Line number in ``old`` -> the same line's number in ``new``, for the lines the change left alone
    (difflib's matching blocks: a line inserted above shifts the ones below; an edited or removed line
    has no entry). 1-based, as coverage.py counts."""
    a, b = old.splitlines(), new.splitlines()
    out = {}
    for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        out.update({block.a + i + 1: block.b + i + 1 for i in range(block.size)})
    return out


def compare(before: dict[str, set[int]], after: dict[str, set[int]],
            maps: dict[str, dict[int, int]]) -> tuple[list[str], list[str], list[str]]:
    """(lost, gained, changed) as ``file:line``: a line covered before whose unchanged line is not covered
    after; a line covered after with no covered counterpart before; a line covered before that the second
    commit edited or removed (no counterpart to compare). Lines are matched through ``maps``
    (:func:`map_lines` per file), so a commit that inserts lines does not read as a loss below them."""
    lost, changed, seen = [], [], {}
    for f, lines in before.items():
        m, got = maps.get(f, {}), after.get(f, set())
        for ln in sorted(lines):
            if ln not in m:
                changed.append(f"{f}:{ln}")
            elif m[ln] not in got:
                lost.append(f"{f}:{ln}")
            else:
                seen.setdefault(f, set()).add(m[ln])
    gained = [f"{f}:{ln}" for f, lines in sorted(after.items()) for ln in sorted(lines - seen.get(f, set()))]
    return sorted(lost), gained, sorted(changed)


if __name__ == "__main__":
    sys.exit(main())
