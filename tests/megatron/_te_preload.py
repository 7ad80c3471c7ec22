"""Imported first by the TE ranks' fork server (tests/megatron/_dist.py, ``TE_PRELOAD``): the
Transformer Engine stand-in (te_stub/transformer_engine) goes first on the path and is imported,
so that megatron-core, imported next, finds it as it finds an installed TE. Nothing else."""

import sys

from tests.megatron._dist import TE_STUB

assert "megatron.core" not in sys.modules, "megatron-core was imported before the TE stand-in"
sys.path.insert(0, TE_STUB)
import transformer_engine  # noqa: E402,F401  (the stand-in)
