import contextlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# nothing in the tests may reach a model or dataset hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# A Python that imports real vLLM (vllm-cpu), for the tests that run vLLM: HAPO_VLLM_PYTHON
# (.ci/run builds .venv-vllm: vllm-cpu cannot share this environment, its torchvision breaks
# the CPU torch), or this interpreter if it has vLLM. Decided here, before any import stub of
# vLLM goes on the path. HAPO_REQUIRE_VLLM=1 (set by .ci/run) makes a missing one a failure.
VLLM_PYTHON = os.environ.get("HAPO_VLLM_PYTHON") or (sys.executable if importlib.util.find_spec("vllm") else None)
# vLLM's CPU back end on a shared 2-core machine: a 1 GiB KV cache (not a share of RAM), no thread pinning
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _require_vllm():
    if os.environ.get("HAPO_REQUIRE_VLLM") == "1":
        if not VLLM_PYTHON:
            raise pytest.UsageError("HAPO_REQUIRE_VLLM=1 but no Python with vllm-cpu: set HAPO_VLLM_PYTHON (see .ci/run)")
        if not os.access(VLLM_PYTHON, os.X_OK):
            raise pytest.UsageError(f"HAPO_VLLM_PYTHON={VLLM_PYTHON} is not an executable")


# The longest tests, longest first (measured: docs/performance.md, "Test suite"). pytest-xdist
# hands tests out in collection order, so starting these first keeps one of them from being
# the last thing running while the other workers sit idle.
LONGEST_FIRST = ("test_e2e.py::", "test_e2e_async.py::", "test_timeout_then_resubmit", "test_preempt_checkpoint_requeue",
                 "test_e2e_megatron.py::", "test_scale_submits_and_collects", "test_vllm_engine_evaluates",
                 "test_experiment_cli_smoke", "test_seed_array", "test_corrupt_newest_checkpoint",
                 "test_sigkill_then_resume", "test_tp2_checkpoint_resumes_exactly")


def pytest_collection_modifyitems(config, items):
    _require_vllm()

    def rank(item):
        return next((i for i, key in enumerate(LONGEST_FIRST) if key in item.nodeid), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: everything else keeps its order


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


def run_cli(args, cwd=REPO, timeout=600, **kw):
    """The real `hapo` CLI in a subprocess (the way a user runs it)."""
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "hapo_openrlhf", *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, **kw,
    )


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
