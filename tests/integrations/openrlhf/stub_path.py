"""The OpenRLHF integration tests' import path, put in place on import: the CPU shim's directory
(``hapo_cpu_shim``), and the import-only stubs in ``shim/stubs`` for whichever of flash-attn and
vLLM is not installed (OpenRLHF imports both at module level; see conftest.py).

Imported by this directory's conftest.py, and by name first in the Megatron ranks' fork servers'
preload (``tests/megatron/_dist.py``). multiprocessing's fork server starts from the interpreter's
default path, not the test process's: Python 3.11-3.13 pass it the parent's ``sys_path`` and do not
apply it. Without this module there, the preload of the Megatron policy actor failed on flash-attn,
which the fork server skips without a word, and every rank of the actor's tests imported OpenRLHF,
DeepSpeed and datasets again (about 2 CPU-s a rank; issue 57)."""

import importlib.util
import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "shim"
STUBBED = ("vllm", "flash_attn")  # stubs/<name>/<name>: only a missing package is stubbed


def install() -> None:
    """The shim's directory, then each missing package's stub, first on ``sys.path`` (once)."""
    paths = [str(SHIM), *(str(SHIM / "stubs" / m) for m in STUBBED if importlib.util.find_spec(m) is None)]
    for p in paths:
        if p not in sys.path:
            sys.path.insert(0, p)


install()
