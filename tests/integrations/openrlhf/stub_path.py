"""The OpenRLHF integration tests' import path, put in place on import: the CPU shim's directory
(``hapo_cpu_shim``), and before it the import-only stubs of whichever of flash-attn and vLLM is not
installed (``hapo_cpu_shim.stubs_first``; OpenRLHF imports both at module level, see conftest.py).

Imported by this directory's conftest.py, and by name first in the Megatron ranks' fork servers'
preload (``tests/megatron/_dist.py``). multiprocessing's fork server starts from the interpreter's
default path, not the test process's: Python 3.11-3.13 pass it the parent's ``sys_path`` and do not
apply it. Without this module there, the preload of the Megatron policy actor failed on flash-attn,
which the fork server skips without a word, and every rank of the actor's tests imported OpenRLHF,
DeepSpeed and datasets again (about 2 CPU-s a rank; issue 57)."""

import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "shim"


def install() -> None:
    """The shim's directory, then each missing package's stub, first on ``sys.path`` (once)."""
    if str(SHIM) not in sys.path:
        sys.path.insert(0, str(SHIM))
    import hapo_cpu_shim

    hapo_cpu_shim.stubs_first()  # (done on its first import; again here if the path was reset since)


install()
