"""The full-size dry run of a ``backend: megatron`` config: every rank role of its layout
started at the model's real size, on this CPU, with no GPU and no weights.

    python -m hapo_openrlhf.megatron.dryrun --config CONFIG [--set K=V] [--gpu-gb 80] [--json]
    hapo doctor --config CONFIG          (runs it as a child process; one line per rank role)

For each distinct rank role of the config's world (``openrlhf.actor_num_nodes x
actor_gpus_per_node`` ranks): the first, a middle and the last pipeline stage, tensor-parallel
rank 0 and the last, expert-parallel rank 0 and the last, one process joins torch's fake
process group as that rank and runs the Megatron actor's own start-up (:mod:`.setup`):
megatron-core's parallel state in the actor's rank order, the ``GPTModel`` stage on the meta
device (shapes, no storage) from the model's real ``config.json``, every tensor the converter
would load into it from the Hugging Face checkpoint (names and shapes from the config, meta
tensors: a missing, unexpected or mis-shaped tensor fails), megatron-core's DDP wrapper and its
(distributed) optimizer. Then, per rank, the memory those objects hold -- weights and gradient
buffers as allocated, the optimizer's fp32 masters and Adam moments from its own parameter
shards -- and the activations at the config's token budget (:func:`.memory.activation_bytes`,
arithmetic: nothing runs forward here) against the GPU's memory.

The model's ``config.json`` comes from a local model directory, the Hugging Face cache, or the
copies shipped in ``model_configs/`` (each with its source) for the models shipped configs name.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

GB = 1024 ** 3
# CUDA context, NCCL buffers and allocator fragmentation: left out of the arithmetic, kept free
RESERVE_GB = 3.0
MODEL_CONFIGS = Path(__file__).with_name("model_configs")
# hub ids -> the shipped config.json of their architecture (model_configs/README.md has the sources)
SHIPPED = {
    "Qwen/Qwen2.5-Math-7B": "qwen2.5-math-7b.json",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": "deepseek-r1-distill-qwen-1.5b.json",
    "agentica-org/DeepScaleR-1.5B-Preview": "deepseek-r1-distill-qwen-1.5b.json",
    "cmu-deepscaler-colab/DeepScaleR-8K": "deepseek-r1-distill-qwen-1.5b.json",
    "Qwen/Qwen3-8B-Base": "qwen3-8b-base.json",
    "Qwen/Qwen3-30B-A3B-Base": "qwen3-30b-a3b-base.json",
    # not a hub id: the directory `hapo extend-context Qwen/Qwen3-8B-Base models/Qwen3-8B-Base-yarn4 --factor 4`
    # writes (the 128k config's model): Qwen3-8B-Base's config.json with the model card's YaRN
    "models/Qwen3-8B-Base-yarn4": "qwen3-8b-base-yarn4.json",
}


@dataclass
class RankReport:
    rank: int
    role: str
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_rank: int
    params: int  # this rank's parameters
    tensors_checked: int  # converter tensors loaded by name and shape
    weights_gb: float
    grads_gb: float
    optimizer_gb: float
    activations_gb: float
    total_gb: float
    seconds: float


@dataclass
class DryRun:
    config: str
    model: str
    model_source: str
    world: int
    layout: dict[str, int]
    tokens_per_micro_batch: int
    gpu_gb: float
    ranks: list[RankReport] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def peak_gb(self) -> float:
        return max((r.total_gb for r in self.ranks), default=0.0)

    @property
    def fits(self) -> bool:
        return self.error is None and self.peak_gb + RESERVE_GB <= self.gpu_gb

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peak_gb": self.peak_gb, "fits": self.fits, "reserve_gb": RESERVE_GB}


def model_config(path: str):
    """(transformers config, where it came from) for ``model.path``: a local directory, the
    Hugging Face cache, or the shipped copy of a known model's ``config.json``."""
    from transformers import AutoConfig

    local = Path(path).expanduser()
    if (local / "config.json").is_file():
        return AutoConfig.from_pretrained(str(local)), str(local / "config.json")
    try:
        from huggingface_hub import hf_hub_download

        cached = hf_hub_download(path, "config.json", local_files_only=True)
        return AutoConfig.from_pretrained(str(Path(cached).parent)), f"{cached} (Hugging Face cache)"
    except Exception:  # noqa: BLE001 - not cached, not a hub id, or no huggingface_hub
        pass
    if path in SHIPPED:
        f = MODEL_CONFIGS / SHIPPED[path]
        return AutoConfig.from_pretrained(str(f)), f"hapo_openrlhf/megatron/model_configs/{f.name} (shipped copy)"
    raise ValueError(f"model.path {path!r}: no config.json to build the model from (not a local model directory, "
                     f"not in the Hugging Face cache, not one of the shipped copies: {sorted(SHIPPED)})")


def tokens_per_micro_batch(cfg) -> int:
    """The largest micro-batch the actor runs, in tokens per model replica."""
    o = cfg.openrlhf
    if o.dynamic_batch:
        return int(o.max_tokens_per_gpu)
    return int(o.micro_train_batch_size) * int(o.max_len)


def build_spec(m):
    """The ``megatron`` section the dry run builds each stage with: ``layer_spec: te`` on megatron-core's
    local spec (flash attention), without context parallelism in the model (megatron-core's local
    attention asserts CP 1; the parallel state keeps CP, so DDP and the distributed optimizer shard
    over DP x CP as on the GPUs). The parameters are the same tensors -- TE fuses each norm into the
    linear after it, the local spec keeps it apart, same shapes -- so the weights, gradient buffers
    and optimizer shards counted are the TE model's; what only TE's modules do (its CUDA kernels,
    workspace, the CP ring) is not started on this CPU."""
    if m.layer_spec != "te":
        return m
    return replace(m, layer_spec="local", attention="flash", sequence_parallel=False, context_parallel=1)


def _role(ranks) -> tuple[str, int, int]:
    pp = "only stage" if ranks.pp == 1 else (
        "first stage" if ranks.pp_rank == 0 else "last stage" if ranks.pp_rank == ranks.pp - 1 else "middle stage")
    return pp, ranks.tp_rank, ranks.ep_rank


def _wanted(ranks) -> bool:
    """A rank of a role the dry run builds: TP 0 or last, EP 0 or last, PP first / one middle / last."""
    mid = ranks.pp // 2
    return (ranks.tp_rank in (0, ranks.tp - 1) and ranks.ep_rank in (0, ranks.ep - 1)
            and ranks.pp_rank in {0, mid, ranks.pp - 1})


class MetaCheckpoint(dict):
    """A Hugging Face checkpoint of ``hf_config``'s names and shapes (``convert.hf_shapes``) as
    meta tensors in the checkpoint's dtype, made as the converter asks for them."""

    def __init__(self, hf_config, dtype) -> None:
        from .convert import hf_shapes

        super().__init__()
        self.shapes, self.dtype, self.read = hf_shapes(hf_config), dtype, set()

    def __getitem__(self, key):
        import torch

        if key not in self.shapes:
            raise KeyError(f"{key} is not in the checkpoint")
        self.read.add(key)
        return torch.empty(self.shapes[key], dtype=self.dtype, device="meta")

    def __contains__(self, key) -> bool:
        return key in self.shapes

    def __iter__(self):
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _rank_memory(cfg, hf_config, ranks, model, ddp, optimizer, tokens: int) -> dict[str, float]:
    from .convert import padded_vocab_size
    from .memory import activation_bytes

    m = cfg.megatron
    buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))
    param_buffers = [b.param_data for b in buffers if b.param_data is not None]
    weights = _bytes(param_buffers) if param_buffers else _bytes(model.parameters())
    grads = _bytes(b.grad_data for b in buffers)
    main = [p for opt in optimizer.torch_optimizers for g in opt.param_groups for p in g["params"]]
    masters = _bytes(main) if m.params_dtype != "fp32" else 0  # fp32 copies of a bf16 model's shards
    moments = 2 * sum(p.numel() * 4 for p in main)  # AdamW's exp_avg and exp_avg_sq, fp32, created at step 1
    stage_layers = len(model.decoder.layers)
    inflight = ranks.pp - ranks.pp_rank if ranks.pp > 1 else 1  # 1F1B: warm-up micro-batches of this stage
    acts = activation_bytes(hf_config, layers=stage_layers, tokens=tokens, tp=ranks.tp,
                            sequence_parallel=m.sequence_parallel, inflight=inflight, recompute=m.recompute,
                            padded_vocab=padded_vocab_size(hf_config.vocab_size, ranks.tp, m.vocab_multiple),
                            head_chunk=int(cfg.algorithm.entropy_chunk_size or 1024), cp=ranks.cp,
                            cp_comm_type=m.cp_comm_type)
    out = {"weights_gb": weights / GB, "grads_gb": grads / GB, "optimizer_gb": (masters + moments) / GB,
           "activations_gb": acts / GB}
    out["total_gb"] = sum(out.values())
    return out


def _start_rank(cfg, hf_config, rank: int, world: int, build: bool, tokens: int) -> tuple[Any, RankReport | None]:
    """Join the fake world as ``rank`` and run the actor's start-up (``build``: the model,
    weights and optimizer too). Returns (the rank's place, its report or None)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .ddp import MegatronOptimizer, use_distributed_optimizer, wrap
    from .setup import build_stage, init_parallel_state, load_hf_weights

    m = cfg.megatron
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        ranks = init_parallel_state(m.tensor_parallel, m.pipeline_parallel, m.expert_parallel, m.context_parallel)
        if not build or not _wanted(ranks):
            return ranks, None
        built, on = build_spec(m), replace(ranks, cp=1)  # TE's spec on the local one (build_spec)
        with torch.device("meta"):
            model = build_stage(hf_config, built, on, routing_replay=cfg.routing_replay, cuda=False)
        source = MetaCheckpoint(hf_config, torch.bfloat16)
        load_hf_weights(model, source, hf_config, built, on, what=cfg.model.path)
        ddp = wrap(model, distributed_optimizer=use_distributed_optimizer(m.distributed_optimizer, ranks.dp_cp_size))
        opt = MegatronOptimizer(ddp, lr=cfg.optim.lr, sharding=m.optimizer_sharding)
        mem = _rank_memory(cfg, hf_config, ranks, model, ddp, opt, tokens)
        pp, tp, ep = _role(ranks)
        role = f"{pp} {ranks.pp_rank}/{ranks.pp}, TP rank {tp}/{ranks.tp}, EP rank {ep}/{ranks.ep}" + (
            f", CP rank {ranks.cp_rank}/{ranks.cp}" if ranks.cp > 1 else "")
        report = RankReport(rank=rank, role=role, tp_rank=ranks.tp_rank, pp_rank=ranks.pp_rank, ep_rank=ranks.ep_rank,
                            dp_rank=ranks.dp_rank, params=sum(p.numel() for p in model.parameters()),
                            tensors_checked=len(source.read), seconds=round(time.perf_counter() - t0, 2), **mem)
        return ranks, report
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def dry_run(cfg, *, gpu_gb: float = 80.0, config_name: str = "") -> DryRun:
    """Every rank role of ``cfg``'s Megatron layout started at full size (module docstring).
    A start-up that fails is reported in :attr:`DryRun.error` with the rank it failed on."""
    from .meta_platform import meta_platform

    o, m = cfg.openrlhf, cfg.megatron
    world = o.actor_num_nodes * o.actor_gpus_per_node
    tokens = tokens_per_micro_batch(cfg)
    layout = {"tp": m.tensor_parallel, "pp": m.pipeline_parallel, "ep": m.expert_parallel,
              "cp": m.context_parallel, "dp": world // max(1, m.model_parallel_size)}
    try:
        hf_config, source = model_config(cfg.model.path)
    except ValueError as e:
        return DryRun(config_name, cfg.model.path, "", world, layout, tokens, gpu_gb, error=str(e))
    run = DryRun(config_name, cfg.model.path, source, world, layout, tokens, gpu_gb)
    if m.layer_spec == "te":
        run.notes.append("layer_spec te: each stage is built on megatron-core's local spec (the same parameters, "
                         "by the local names); Transformer Engine's own modules are not started here")
    seen: set[tuple] = set()
    rank = 0
    with meta_platform():
        try:
            for rank in range(world):
                ranks, _ = _start_rank(cfg, hf_config, rank, world, build=False, tokens=tokens)
                key = _role(ranks)
                if key in seen or not _wanted(ranks):
                    continue
                seen.add(key)
                _, report = _start_rank(cfg, hf_config, rank, world, build=True, tokens=tokens)
                run.ranks.append(report)
        except Exception as e:  # noqa: BLE001 - whatever stops a rank's start-up is the finding
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            run.error = f"rank {rank} of {world}: {type(e).__name__}: {first}"
    return run


def table(run: DryRun) -> str:
    """The dry run as a markdown table, one row per rank role."""
    cp = f"CP {run.layout['cp']} x " if run.layout.get("cp", 1) > 1 else ""
    head = (f"{run.config}: {run.model} ({run.model_source}); world {run.world} = TP {run.layout['tp']} x "
            f"{cp}PP {run.layout['pp']} x DP {run.layout['dp']} (EP {run.layout['ep']}); "
            f"{run.tokens_per_micro_batch} tokens per micro-batch{' per CP rank' if cp else ''}\n\n"
            + "".join(f"note: {n}\n\n" for n in run.notes))
    rows = ["| rank | role | params | weights | grads | optimizer | activations | total GB |",
            "|---|---|---|---|---|---|---|---|"]
    for r in run.ranks:
        rows.append(f"| {r.rank} | {r.role} | {r.params / 1e9:.2f}B | {r.weights_gb:.1f} | {r.grads_gb:.1f} | "
                    f"{r.optimizer_gb:.1f} | {r.activations_gb:.1f} | {r.total_gb:.1f} |")
    tail = (f"\n\nerror: {run.error}" if run.error else
            f"\n\npeak {run.peak_gb:.1f} GB + {RESERVE_GB:.0f} GB reserve "
            f"{'<=' if run.fits else '>'} {run.gpu_gb:.0f} GB: {'fits' if run.fits else 'does not fit'}")
    return head + "\n".join(rows) + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hapo_openrlhf.megatron.dryrun", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--gpu-gb", type=float, default=80.0, help="memory of one GPU (default 80)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import math
    import warnings

    if not (math.isfinite(args.gpu_gb) and args.gpu_gb > 0):
        ap.error(f"--gpu-gb must be a positive number of GB (one GPU's memory), got {args.gpu_gb}")

    warnings.filterwarnings("ignore")  # megatron-core's notices about Apex / Transformer Engine
    from ..config import load_config

    cfg = load_config(args.config, args.set)
    if cfg.backend != "megatron":
        print(f"{args.config}: backend {cfg.backend}, not megatron: no dry run", file=sys.stderr)
        return 2
    run = dry_run(cfg, gpu_gb=args.gpu_gb, config_name=args.config)
    print(json.dumps(run.to_dict(), indent=1) if args.json else table(run))
    return 0 if run.fits else 1


if __name__ == "__main__":
    sys.exit(main())
