import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# nothing in the tests may reach a model or dataset hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


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
