"""TEST-ONLY stub (see vllm/__init__.py)."""


def TokensPrompt(prompt_token_ids):  # noqa: N802 - vLLM's TypedDict constructor
    return {"prompt_token_ids": prompt_token_ids}
