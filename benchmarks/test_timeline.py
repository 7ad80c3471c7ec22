"""Where the test suite's wall time goes: reads the timeline that tests/conftest.py writes
when HAPO_TEST_TIMELINE=FILE is set (one "worker start end cpu=SECONDS pid=PID nodeid" line per
test; older files without ``pid=`` or ``cpu=`` read too)
and prints the wall time, each worker's busy time and test count, the longest tests, the
tests that used the most CPU, and the tests the last worker ran in its last stretch (the
tail that decides the wall time).

    HAPO_TEST_TIMELINE=/tmp/timeline.txt bash scripts/test.sh
    python benchmarks/test_timeline.py /tmp/timeline.txt [--top 25]

The last line is JSON: wall_s, busy_s per worker, and the tests over 60 s.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def load(path: str) -> tuple[list[tuple[str, float, float, str]], dict[str, float]]:
    """The rows (worker, start, end, nodeid) and each test's CPU seconds where recorded."""
    rows, cpu = [], {}
    with open(path) as f:
        for ln in f:
            w, a, b, node = ln.rstrip("\n").split(" ", 3)
            c = None
            if node.startswith("cpu="):
                c, node = node.split(" ", 1)
            if node.startswith("pid="):
                node = node.split(" ", 1)[1]
            if c is not None:
                cpu[node] = float(c[4:])
            rows.append((w, float(a), float(b), node))
    if not rows:
        raise SystemExit(f"{path}: no tests recorded")
    return rows, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    rows, cpu = load(args.timeline)
    t0, t1 = min(r[1] for r in rows), max(r[2] for r in rows)
    per = defaultdict(list)
    for r in rows:
        per[r[0]].append(r)
    print(f"{len(rows)} tests, wall {t1 - t0:.0f} s ({(t1 - t0) / 60:.1f} min) from the first test's start")
    busy = {}
    for w, rs in sorted(per.items()):
        busy[w] = sum(b - a for _, a, b, _ in rs)
        end = max(b for _, _, b, _ in rs) - t0
        print(f"  {w}: {len(rs)} tests, busy {busy[w]:.0f} s, last test ends at {end:.0f} s")
    print(f"\nlongest {args.top} tests (start..end from the first test's start):")
    for w, a, b, node in sorted(rows, key=lambda r: r[1] - r[2])[: args.top]:
        print(f"  {b - a:7.1f} s  {w:5s} {a - t0:6.0f}..{b - t0:6.0f}  {node}")
    if cpu:
        total = sum(cpu.values())
        print(f"\nCPU (worker + waited-for subprocesses; Slurm jobs and Ray actors of a still-running "
              f"cluster not counted): {total:.0f} s; the {args.top} largest:")
        for node, c in sorted(cpu.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {c:7.1f} s  {node}")
    # concurrency: how many workers are inside a test, sampled every 10 s
    print("\nworkers inside a test, every 60 s:")
    line = []
    for s in range(0, int(t1 - t0) + 1, 60):
        t = t0 + s
        line.append(str(sum(a <= t < b for _, a, b, _ in rows)))
    print("  " + " ".join(line))
    last = max(per.items(), key=lambda kv: max(b for _, _, b, _ in kv[1]))
    print(f"\n{last[0]} finishes last; its tests over 20 s, in order:")
    for _, a, b, node in sorted(last[1], key=lambda r: r[1]):
        if b - a > 20:
            print(f"  {a - t0:6.0f}..{b - t0:6.0f}  {b - a:6.1f} s  {node}")
    failed = [n for _, _, _, n in rows if n.startswith("FAILED ")]
    if failed:
        print(f"\n{len(failed)} failed:\n  " + "\n  ".join(failed))
    print(json.dumps({"wall_s": round(t1 - t0, 1), "tests": len(rows), "failed": len(failed), "busy_s": {k: round(v) for k, v in busy.items()},
                      "over_60s": {n: round(b - a) for _, a, b, n in rows if b - a > 60},
                      "cpu_s": round(sum(cpu.values()))}))


if __name__ == "__main__":
    main()
