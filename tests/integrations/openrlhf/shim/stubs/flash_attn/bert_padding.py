"""TEST-ONLY stub (see flash_attn/__init__.py): importable, but packing needs the real flash-attn."""

from einops import rearrange  # noqa: F401  (re-exported, as upstream does)


def _absent(*_a, **_k):
    raise RuntimeError("flash-attn is not installed: packed samples (--ds.packing_samples) need it")


index_first_axis = pad_input = unpad_input = _absent
