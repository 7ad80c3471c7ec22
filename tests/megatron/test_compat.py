"""megatron-core version differences (hapo_openrlhf/megatron/compat.py): building the model
under 0.19.x logs no "GPTModel IS DEPRECATED" and warns no "full scope is deprecated" (both
megatron-core's own, neither actionable by a user), while anything else megatron-core logs or
warns still gets through. Under 0.16.1 neither notice exists; the filters are checked
directly there too."""

import logging
import warnings

import torch

from ._dist import init_megatron, spawn
from .test_convert import tiny_qwen2


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def _worker(rank, out):
    import megatron.core

    from hapo_openrlhf.megatron.model import build_gpt_model

    init_megatron()
    log = logging.getLogger("megatron.core.models.gpt.gpt_model")
    got = _Records()
    log.addHandler(got)
    log.setLevel(logging.DEBUG)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        build_gpt_model(tiny_qwen2(True, layers=1).config)
        # the filters drop exactly the known notices: another message of the same logger and
        # another megatron-core warning get through
        log.warning("GPTModel IS DEPRECATED. (a repeat)")
        log.warning("something else megatron-core says")
        warnings.warn_explicit("another warning", UserWarning, "transformer_config.py", 1,
                               module="megatron.core.transformer.transformer_config")
        warnings.warn_explicit("full scope is deprecated. x", UserWarning, "transformer_config.py", 1,
                               module="megatron.core.transformer.transformer_config")
    torch.save({"version": megatron.core.__version__, "logged": got.records,
                "warned": [str(w.message) for w in warned]}, out)


def test_known_megatron_core_notices_are_quiet_and_nothing_else_is(tmp_path):
    out = tmp_path / "res.pt"
    spawn(_worker, 1, str(out))
    res = torch.load(out)
    assert not any(m.startswith("GPTModel IS DEPRECATED") for m in res["logged"]), res
    assert "something else megatron-core says" in res["logged"]
    assert not any("full scope is deprecated" in w for w in res["warned"]), res["warned"]
    assert "another warning" in res["warned"]
