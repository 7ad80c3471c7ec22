"""How fast this machine is at the moment, in the kinds of work the test suite does (issue 57):
the same code has taken 16.3 to 19.9 minutes of tests on the same 2-core machine, idle, within a
day, and an embedded RL step 145-151 ms one hour and 249 ms another. A wall time means little without
the machine's speed beside it; ``scripts/test.sh`` prints this probe's line before and after the
tests, so each run's figure comes with it.

    python benchmarks/machine_speed.py [--repeats 3]

Four fixed workloads, one thread each, each timed ``--repeats`` times (the median kept):
* ``python``: the interpreter alone -- compiling and running a fixed piece of source (what
  imports, Ray's and pytest's own code spend most of the suite's CPU on);
* ``torch_ops``: 27,000 small tensor operations on ``[128, 96]`` tensors (the embedded
  trainer's and the gloo ranks' per-operation cost: dispatch, not arithmetic);
* ``gemm``: ``[256, 256] @ [256, 256]`` float32 products (the arithmetic);
* ``import_torch``: a fresh interpreter's ``import torch``, its CPU seconds (the suite starts
  hundreds of interpreters).

Prints one JSON line: each workload's median wall seconds and CPU seconds, and ``index``: the
geometric mean of the four CPU medians' ratios to :data:`REFERENCE` (1.0: as fast as when the
reference was measured; 1.5: the same work takes half as long again). CPU seconds, not wall: a
process beside the probe takes the cores from it, which is not the machine being slower (the
wall seconds say how much it was taken). The reference is a unit, not a
target: it was measured on this 2-core machine on 2026-12-07 (docs/performance.md, "Test suite").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

# median seconds (wall and CPU alike) of each workload over four runs of this script on the 2-core machine, idle, at
# 2026-12-07 19:42 UTC; in between, vs_trl.py's embedded step took 249 ms in the median (145-151 ms earlier
# the same day: the machine was faster then; and the probe's runs differ by up to 40% among themselves)
REFERENCE = {"python": 0.40, "torch_ops": 0.31, "gemm": 0.30, "import_torch": 1.96}

_SOURCE = "\n".join(
    f"def f{i}(x, y={i}):\n    d = {{k: k * y for k in range(40)}}\n"
    f"    return sorted(d.values(), reverse=x)[:{i % 7 + 1}]"
    for i in range(300))


def _python() -> None:
    for _ in range(16):
        ns: dict = {}
        exec(compile(_SOURCE, "<probe>", "exec"), ns)
        for i in range(300):
            ns[f"f{i}"](i % 2 == 0)


def _torch_ops() -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(128, 96, generator=g), torch.randn(128, 96, generator=g)
    idx = torch.arange(0, 128, 2)
    for _ in range(3000):
        c = a * b + a
        c = c.softmax(-1)
        c = c[idx].sum(-1)
        a = torch.addcmul(a, b, b, value=1e-3)
        b = b.masked_fill(b > 3, 0.0)
        float(c[0])


def _gemm() -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 256, generator=g), torch.randn(256, 256, generator=g)
    for _ in range(800):
        torch.mm(a, b)


def _import_torch() -> float:
    """CPU seconds of a fresh interpreter importing torch (its own and its children's)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", "import torch"], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    extra = fn()
    return time.perf_counter() - w, (time.process_time() - c) + (extra or 0.0)


def measure(repeats: int) -> dict:
    import torch

    torch.set_num_threads(1)
    _torch_ops()  # first-call costs (allocator, kernels) out of the timed runs
    _gemm()
    out: dict = {"repeats": repeats}
    for name, fn in (("python", _python), ("torch_ops", _torch_ops), ("gemm", _gemm), ("import_torch", _import_torch)):
        runs = [_timed(fn) for _ in range(repeats)]
        out[name] = {"wall_s": round(statistics.median(r[0] for r in runs), 4),
                     "cpu_s": round(statistics.median(r[1] for r in runs), 4)}
    # the geometric mean of the four ratios: each workload counts alike
    out["index"] = round(math.prod(out[k]["cpu_s"] / REFERENCE[k] for k in REFERENCE) ** (1 / len(REFERENCE)), 3)
    return out


def main(argv: list[str] | None = None) -> None:
    from _args import positive_int  # benchmarks/_args.py (the script's own folder is on sys.path)

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=positive_int, default=3, help="timed runs of each workload (median kept)")
    a = ap.parse_args(argv)
    print(json.dumps(measure(a.repeats)))


if __name__ == "__main__":
    main()
