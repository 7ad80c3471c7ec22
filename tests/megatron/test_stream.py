"""Streamed Megatron -> Hugging Face weights (``convert.stream_hf_tensors``, the vLLM
weight sync and the final save): at TP=2 x PP=2, and at TP=2 x DP=2, global rank 0
receives every Hugging Face tensor exactly once, in ``hf_shapes`` order, bitwise equal
to the model the shards were loaded from; no other rank receives anything. And a model
built without random initialisation carries the same tensor-parallel tags."""

import pytest
import torch

from ._dist import init_megatron, load_hf_into, spawn
from .test_convert import tiny_qwen2


def _worker(rank, tp, pp, tied, out):
    from megatron.core import parallel_state as ps

    from hapo_openrlhf.megatron.convert import gather_hf_state_dict, hf_shapes, stream_hf_tensors
    from hapo_openrlhf.megatron.model import build_qwen2_gpt_model

    init_megatron(tp=tp, pp=pp)
    hf = tiny_qwen2(tied, layers=4)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    model = build_qwen2_gpt_model(hf.config, tp=tp, pp=pp, pp_rank=pp_rank)
    load_hf_into(model, hf, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank)
    # built without random initialisation (as the actor builds it): the same tensor-parallel tags
    bare = build_qwen2_gpt_model(hf.config, tp=tp, pp=pp, pp_rank=pp_rank, perform_initialization=False)
    tags = ("tensor_model_parallel", "partition_dim", "partition_stride")
    for (name, p), (_, q) in zip(model.named_parameters(), bare.named_parameters()):
        assert [getattr(p, t, None) for t in tags] == [getattr(q, t, None) for t in tags], name
    got = []
    n = stream_hf_tensors(model, hf.config, lambda name, t: got.append((name, t.clone())))
    sd = gather_hf_state_dict(model, hf.config)
    if rank != 0:
        assert n == 0 and got == [] and sd is None
        return
    shapes = hf_shapes(hf.config)
    assert [name for name, _ in got] == list(shapes) and n == len(shapes)
    ref = hf.state_dict()
    for name, t in got:
        assert tuple(t.shape) == shapes[name], name
        assert torch.equal(t, ref[name]), name
        assert torch.equal(sd[name], ref[name]), name
    assert set(sd) == set(shapes) and set(ref) - set(shapes) <= {"lm_head.weight"}
    torch.save({"ok": True, "n": n}, out)


@pytest.mark.parametrize("tp, pp, world, tied", [(2, 2, 4, True), (2, 1, 4, False)])
def test_streamed_weights_equal_the_loaded_model(tmp_path, tp, pp, world, tied):
    out = tmp_path / "ok.pt"
    spawn(_worker, world, tp, pp, tied, str(out))
    res = torch.load(out)
    assert res["ok"] and res["n"] == 1 + 4 * 12 + 1 + (not tied)
