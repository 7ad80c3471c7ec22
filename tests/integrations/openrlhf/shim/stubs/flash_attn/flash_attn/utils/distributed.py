"""TEST-ONLY stub (see flash_attn/__init__.py): only ring attention calls ``all_gather``."""


def all_gather(*_a, **_k):
    raise RuntimeError("flash-attn is not installed: ring attention (--ds.ring_attn_size > 1) needs it")
