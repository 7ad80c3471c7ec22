"""Per-GPU memory arithmetic of the Megatron actor for a layout (docs/megatron.md, "Mixture of
experts": Qwen3-30B-A3B at 24k tokens on 80 GB GPUs). Arithmetic, not a measurement: it counts
what the actor allocates by design and names what it leaves out.

Counted, per rank of a TP x PP x EP x DP layout (EP inside DP; expert tensor parallelism = TP):

* **weights** in bf16 (2 B / parameter): the dense part (attention, norms, routers) split over TP
  and PP, the embedding on the first stage and the head on the last (each split over TP), the
  experts split over EP, TP and PP;
* **gradients**: Megatron DDP's fp32 buffers (4 B / parameter, the whole rank's parameters);
* **optimizer**: fp32 masters and two Adam moments (12 B / parameter), sharded over the data-
  parallel ranks by the distributed optimizer -- the dense part over DP, the experts over the
  expert-data-parallel ranks (DP / EP) -- or whole with ``distributed_optimizer=False``;
* **activations** with full recomputation (``megatron.recompute``): each layer's input kept,
  [T / TP with sequence parallelism, H] bf16, for the layers of the stage and the micro-batches
  in flight (1F1B: up to PP on the first stage), plus one layer's recompute working set (q/k/v and
  the attention output; the MoE dispatch's k copies of each token and the experts' SwiGLU
  intermediate -- or the dense MLP's); the fused vocabulary-parallel head's chunk of logits
  ([chunk, V / TP] fp32, never [T, V]).

Left out: the CUDA context and NCCL buffers (about 1-3 GB per GPU), allocator fragmentation,
flash-attention's workspace, and the engines' GPUs (vLLM runs on its own).
"""

from __future__ import annotations

from dataclasses import dataclass

from .convert import _dims, padded_vocab_size
from .families import moe_of

GB = 1024 ** 3


@dataclass(frozen=True)
class Params:
    embedding: int  # the input embedding
    head: int  # the output layer (0 when tied: the embedding serves)
    dense_per_layer: int  # attention, norms, the router (everything but the experts or the MLP)
    experts_per_layer: int  # all experts of a MoE layer, or the dense MLP
    layers: int
    final_norm: int

    @property
    def total(self) -> int:
        return self.embedding + self.head + self.final_norm + self.layers * (self.dense_per_layer +
                                                                            self.experts_per_layer)


def count_params(hf_config) -> Params:
    """The parameter count of a supported family's config, by part."""
    H, nq, nkv, d = _dims(hf_config)
    V = hf_config.vocab_size
    moe = moe_of(hf_config)
    attn = H * nq * d + 2 * H * nkv * d + nq * d * H + 2 * H  # q, k, v, o and the two norms
    if getattr(hf_config, "model_type", "") in ("qwen3", "qwen3_moe"):
        attn += 2 * d  # QK-norm
    if getattr(hf_config, "model_type", "") == "qwen2":
        attn += nq * d + 2 * nkv * d  # QKV bias
    if moe is not None:
        attn += moe.num_experts * H  # the router
        mlp = moe.num_experts * 3 * H * moe.ffn
    else:
        mlp = 3 * H * hf_config.intermediate_size
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return Params(V * H, 0 if tied else V * H, attn, mlp, hf_config.num_hidden_layers, H)


def estimate(hf_config, *, tp: int = 1, pp: int = 1, ep: int = 1, dp: int = 1, tokens: int,
             micro_batches_in_flight: int | None = None, sequence_parallel: bool = False,
             distributed_optimizer: bool = True, head_chunk: int = 1024, vocab_multiple: int = 128) -> dict:
    """GB per GPU of the busiest rank (the first stage, which holds the embedding and the most
    micro-batches in flight; the head's stage when PP = 1) for ``tokens`` packed tokens per
    micro-batch; see the module docstring for what is counted."""
    if dp % ep:
        raise ValueError(f"expert parallel size {ep} must divide data parallel size {dp}")
    p = count_params(hf_config)
    H = hf_config.hidden_size
    moe = moe_of(hf_config)
    L = p.layers // pp
    Vp = padded_vocab_size(hf_config.vocab_size, tp, vocab_multiple)
    emb = Vp * H // tp
    head = (Vp * H // tp if p.head else 0) if pp == 1 else 0  # with PP > 1 the first stage has no head
    dense = L * p.dense_per_layer // tp + emb + head + (p.final_norm if pp == 1 else 0)
    experts = L * p.experts_per_layer // (tp * (ep if moe is not None else 1))
    params = dense + experts
    weights = 2 * params
    grads = 4 * params
    edp = dp // ep if moe is not None else dp
    optim = 12 * (dense / dp + experts / edp) if distributed_optimizer else 12 * params
    inflight = micro_batches_in_flight if micro_batches_in_flight is not None else pp
    acts = activation_bytes(hf_config, layers=L, tokens=tokens, tp=tp, sequence_parallel=sequence_parallel,
                            inflight=inflight, padded_vocab=Vp, head_chunk=head_chunk)
    out = {"params_per_gpu_billion": params / 1e9, "weights_gb": weights / GB, "grads_gb": grads / GB,
           "optimizer_gb": optim / GB, "activations_gb": acts / GB}
    out["total_gb"] = sum(v for k, v in out.items() if k.endswith("_gb"))
    return out


def activation_bytes(hf_config, *, layers: int, tokens: int, tp: int = 1, sequence_parallel: bool = False,
                     inflight: int = 1, padded_vocab: int, head_chunk: int = 1024, recompute: bool = True,
                     cp: int = 1, cp_comm_type: str = "p2p") -> int:
    """Bytes of activations on a rank holding ``layers`` layers with full recomputation, for
    ``tokens`` packed tokens per micro-batch and ``inflight`` micro-batches in flight (1F1B: up
    to PP on the first stage); see the module docstring for what is counted. Without
    ``recompute`` every layer keeps its working set (a lower bound: autograd keeps more).

    Under context parallelism (``cp`` > 1) ``tokens`` is this CP rank's share (what the actor's
    token budget counts), and the attention's exchange adds to the layer's working set: TE's ring
    (``p2p``) two buffers of the rank's K/V in flight, ``all_gather`` the other ranks' K/V, ``a2a``
    one more copy of q/k/v (its output, every token for 1 / CP of the heads)."""
    H, nq, nkv, d = _dims(hf_config)
    moe = moe_of(hf_config)
    t_local = tokens // tp if sequence_parallel else tokens
    checkpoints = 2 * t_local * H * layers * inflight
    qkv = 2 * tokens * (nq + 2 * nkv) * d // tp
    attn_out = 2 * tokens * nq * d // tp
    if moe is not None:  # each token's k dispatched copies, the experts' fc1 output and SwiGLU product
        mlp_work = 2 * tokens * moe.top_k * (H + 3 * moe.ffn // tp)
    else:
        mlp_work = 2 * tokens * 3 * hf_config.intermediate_size // tp
    working = qkv + attn_out + mlp_work + 2 * 2 * tokens * H  # + the layer's input and output
    if cp > 1:
        kv_own = 2 * tokens * 2 * nkv * d // tp  # this rank's K and V, bf16
        exchange = {"p2p": 2 * kv_own, "all_gather": (cp - 1) * kv_own, "a2a": qkv}
        if cp_comm_type not in exchange:
            raise ValueError(f"cp_comm_type must be one of {sorted(exchange)}, got {cp_comm_type!r}")
        working += exchange[cp_comm_type]
    head_work = 4 * head_chunk * padded_vocab // tp * 2  # a logits chunk and its softmax, fp32
    if not recompute:
        return working * layers * inflight + head_work
    return checkpoints + working + head_work
