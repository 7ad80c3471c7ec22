"""TEST-ONLY stub (see vllm/__init__.py)."""

import uuid


def random_uuid() -> str:
    return uuid.uuid4().hex
