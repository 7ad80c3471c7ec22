import importlib.util
import os

import pytest

# the `megatron` extra; found without importing it (megatron-core's import is slow and noisy)
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def pytest_collection_modifyitems(config, items):
    if HAVE_MEGATRON:
        return
    if os.environ.get("HAPO_REQUIRE_MEGATRON") == "1":
        raise pytest.UsageError("HAPO_REQUIRE_MEGATRON=1 but megatron-core is not installed (pip install -e '.[megatron]')")
    skip = pytest.mark.skip(reason="megatron-core not installed (the megatron extra)")
    for item in items:
        if "tests/megatron/" in str(item.fspath) and "test_convert" not in str(item.fspath):
            item.add_marker(skip)
