"""Where the test suite's CPU goes, test by test, counting every process a test starts -- Ray
actors, vLLM engines, fork-server ranks, Slurm jobs -- which the timeline's own figure
(``cpu=``: the worker and the subprocesses it waited for) misses (issue 57).

    python benchmarks/suite_cpu.py sample /tmp/samples.txt &      # beside the suite, then kill it
    HAPO_TEST_TIMELINE=/tmp/timeline.txt bash scripts/test.sh
    python benchmarks/suite_cpu.py attribute /tmp/timeline.txt /tmp/samples.txt

``sample`` reads every process's CPU time from /proc every ``--interval`` seconds and writes
"time worker cpu_seconds" lines: each process's CPU since the last sample, credited to the xdist
worker it descends from, the worker's own included (as ``pid:N``, named gwN by ``attribute`` from
the timeline's ``pid=``), or, for a process outside that tree -- a Slurm job -- to the worker named
in its environment; the Python 3.12 leg's processes as ``main``. ``attribute`` credits each
sample to the test that worker was running then (the timeline) and prints the largest files and
tests. A process that starts and ends between two samples is missed: keep the interval short.
Linux only (/proc)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict


def _stat(pid: str):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[11]) + int(fields[12]), fields[19]  # ppid, utime + stime, start


def _worker(pid: int, seen: dict, depth: int = 0) -> str:
    """The xdist worker ``pid`` descends from (``pid:N``, its process id: a worker learns its name
    gwN after it starts, so its /proc environment has none; ``attribute`` names it from the
    timeline), else its environment's gwN (a daemon or Slurm job started by a test), else py312 /
    other."""
    if pid in seen:
        return seen[pid]
    label = "other"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e)
        named = env.get(b"PYTEST_XDIST_WORKER", b"").decode()
        if b"exec(eval(sys.stdin.readline()))" in cmd:  # an xdist worker itself
            label = named or f"pid:{pid}"
        else:
            ppid = _stat(str(pid))[0]
            if ppid > 1 and depth < 40:
                label = _worker(ppid, seen, depth + 1)
            if label == "other":
                label = named or ("main" if b"py312" in cmd or b"python3.12" in cmd else "other")
    except (OSError, ValueError, IndexError):
        pass
    seen[pid] = label
    return label


def sample(out_path: str, interval: float) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    last: dict = {}
    labels: dict = {}
    first = True
    with open(out_path, "a", buffering=1) as out:
        while True:
            now, acc, cur = time.time(), defaultdict(float), {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    _, ticks, start = _stat(pid)
                except (OSError, IndexError):
                    continue
                key = (int(pid), start)
                cur[key] = ticks / tick
                if not first:
                    delta = cur[key] - last.get(key, 0.0)  # a new process: all its CPU so far
                    if delta > 0:
                        if key not in labels:
                            labels[key] = _worker(int(pid), {})
                        acc[labels[key]] += delta
            for label, cpu in acc.items():
                out.write(f"{now:.1f} {label} {cpu:.2f}\n")
            last, first = cur, False
            labels = {k: v for k, v in labels.items() if k in cur}
            time.sleep(interval)


def attribute(timeline: str, samples: str, interval: float, top: int) -> dict:
    spans, pids = defaultdict(list), {}
    for line in open(timeline):
        p = line.split()
        spans[p[0]].append((float(p[1]), float(p[2]), p[-1]))
        pids.update({f"pid:{f[4:]}": p[0] for f in p[3:-1] if f.startswith("pid=")})
    per_test, lost = defaultdict(float), defaultdict(float)
    for line in open(samples):
        t, label, cpu = line.split()
        t, cpu, label = float(t), float(cpu), pids.get(label, label)
        # a sample covers the interval before it: the test running at its time, else one that ended in it
        ours = spans.get(label, ())
        hit = next((n for s, e, n in ours if s <= t <= e), None) or \
            next((n for s, e, n in ours if t - interval <= e < t), None)
        if hit:
            per_test[hit] += cpu
        else:
            lost[label] += cpu
    per_file = defaultdict(float)
    for nodeid, cpu in per_test.items():
        per_file[nodeid.split("::")[0]] += cpu
    total = sum(per_test.values()) + sum(lost.values())
    print(f"{total:.0f} CPU-s sampled; {sum(per_test.values()):.0f} in tests; outside any test: "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(lost.items(), key=lambda x: -x[1])))
    for title, table in (("files", per_file), ("tests", per_test)):
        print(f"--- the {top} largest {title}, CPU-s")
        for name, cpu in sorted(table.items(), key=lambda x: -x[1])[:top]:
            print(f"{cpu:8.1f}  {name}")
    return {"total": total, "files": dict(per_file), "tests": dict(per_test), "outside": dict(lost)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("out")
    s.add_argument("--interval", type=float, default=3.0)
    a = sub.add_parser("attribute")
    a.add_argument("timeline")
    a.add_argument("samples")
    a.add_argument("--interval", type=float, default=3.0)
    a.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    if args.cmd == "sample":
        sample(args.out, args.interval)
    else:
        attribute(args.timeline, args.samples, args.interval, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
