import torch
def run(rank, tp, ep):
    from megatron.core import parallel_state as ps
    from tests.megatron._dist import init_megatron
    from tests.megatron.test_moe import tiny_moe
    from hapo_openrlhf.megatron.model import build_gpt_model
    init_megatron(tp=tp, ep=ep)
    hf = tiny_moe()
    m = build_gpt_model(hf.config, tp=tp, ep=ep, spec="te", sequence_parallel=True, perform_initialization=False)
    if rank == 0:
        for k, v in m.state_dict().items():
            if "layers.0." in k or "layers" not in k:
                print("KEY", k, tuple(v.shape) if hasattr(v, "shape") else type(v))
        for n, p in m.named_parameters():
            if "layers.0." in n:
                print("ATTR", n, getattr(p, "allreduce", None), getattr(p, "sequence_parallel", None), getattr(p, "tensor_model_parallel", None))
