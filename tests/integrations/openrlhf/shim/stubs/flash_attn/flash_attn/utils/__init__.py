"""TEST-ONLY stub (see flash_attn/__init__.py)."""
