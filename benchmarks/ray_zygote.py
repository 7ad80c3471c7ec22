"""What the e2e launches' Ray worker fork server saves (``tests/integrations/openrlhf/shim/ray_zygote.py``,
issue 57): one OpenRLHF e2e test run alone, interleaved ``--repeat`` times with the fork server on
and off (``HAPO_SHIM_ZYGOTE=0``: every Ray worker a fresh interpreter, as Ray starts them), each
timed by its wall clock and by the machine's CPU time over the run (``/proc/stat``: every process
the launch starts, Ray's actors and daemons included, which the test process's own rusage misses).
Run it on an otherwise idle machine: the CPU figure counts everything that ran.

    python benchmarks/ray_zygote.py [--test NODEID] [--repeat 2]

Prints each run, then the medians and on/off ratios; last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = "tests/integrations/openrlhf/test_e2e_async.py::test_async_trainer_with_partial_rollouts_under_hapo"


def _cpu_seconds() -> float:
    """The machine's user + nice + system time so far, all CPUs."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    return (int(fields[0]) + int(fields[1]) + int(fields[2])) / os.sysconf("SC_CLK_TCK")


def run_once(test: str, zygote: bool) -> dict:
    env = {**os.environ, "HAPO_SHIM_ZYGOTE": "1" if zygote else "0", "HAPO_REQUIRE_OPENRLHF": "1"}
    cpu0, t0 = _cpu_seconds(), time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        test], cwd=REPO, env=env, capture_output=True, text=True)
    wall, cpu = time.monotonic() - t0, _cpu_seconds() - cpu0
    if p.returncode != 0:
        sys.exit(f"{test} failed with the fork server {'on' if zygote else 'off'}:\n{(p.stdout + p.stderr)[-4000:]}")
    return {"zygote": zygote, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--test", default=DEFAULT, help="a pytest node id (default: the async e2e test)")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each setting, interleaved (off first)")
    a = ap.parse_args()
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    runs = []
    for _ in range(a.repeat):
        for zygote in (False, True):
            runs.append(run_once(a.test, zygote))
            print(json.dumps(runs[-1]), flush=True)
    med = {z: {k: round(statistics.median(r[k] for r in runs if r["zygote"] == z), 1) for k in ("wall_s", "cpu_s")}
           for z in (False, True)}
    result = {"test": a.test, "repeat": a.repeat, "off": med[False], "on": med[True],
              "cpu_ratio_on_over_off": round(med[True]["cpu_s"] / med[False]["cpu_s"], 3),
              "wall_ratio_on_over_off": round(med[True]["wall_s"] / med[False]["wall_s"], 3)}
    print(f"fork server off: {med[False]['wall_s']:.1f} s wall, {med[False]['cpu_s']:.1f} CPU-s; "
          f"on: {med[True]['wall_s']:.1f} s, {med[True]['cpu_s']:.1f} CPU-s; "
          f"CPU on/off {result['cpu_ratio_on_over_off']:.3f}, wall {result['wall_ratio_on_over_off']:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
