"""How the Megatron policy actor meets the outside world: the Hugging Face checkpoint it starts
from (read lazily, shard by shard; downloaded once per node), the vLLM engines it feeds (one Hugging
Face tensor at a time) and the saves it writes (megatron-core's distributed checkpoints, pruned; the
Hugging Face save, atomically). A mixin of ``megatron_actor.MegatronPolicyActorImpl``, which holds
the state these methods read (``model``, ``hf_config``, ``ddp``, ``optimizer``, ...)."""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist

from ....rundir.fsguard import claim, remove_owned

# OpenRLHF 0.11.2 builds every vLLM engine with dtype="bfloat16" (create_vllm_engines) and its
# WorkerWrap.update_weight asserts the incoming dtype equals the engine's: weights go out in bf16
VLLM_DTYPE = torch.bfloat16
_TAG = re.compile(r"^(best_)?global_step(\d+)$")


def device() -> torch.device:
    """This rank's device: its CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class SafetensorsDir(Mapping):
    """A Hugging Face checkpoint directory's ``*.safetensors`` as a lazy name -> tensor
    mapping: each rank reads only the tensors of its own shard."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self._where: dict[str, Path] = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    self._where[k] = f
        if not self._where:
            raise FileNotFoundError(f"no *.safetensors weights in {str(path)!r}")

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        if key not in self._where:
            raise KeyError(f"{key} is not in the checkpoint")
        with safe_open(str(self._where[key]), "pt") as h:
            return h.get_tensor(key)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def resolve_pretrained(pretrain: str) -> Path:
    """A local checkpoint directory for ``pretrain``. A hub id is downloaded once per
    node: with ``torch.distributed`` up, the lowest global rank of each host downloads
    while the others wait, then they read the same cache offline (collective)."""
    if os.path.isdir(pretrain):
        return Path(pretrain)
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model"]
    if not (dist.is_available() and dist.is_initialized()):
        return Path(snapshot_download(pretrain, allow_patterns=patterns))
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    first = hosts.index(hosts[dist.get_rank()]) == dist.get_rank()
    path = snapshot_download(pretrain, allow_patterns=patterns) if first else None
    dist.barrier()
    if not first:
        path = snapshot_download(pretrain, allow_patterns=patterns, local_files_only=True)
    return Path(path)


def check_tp_peers_share_a_node(tp_group) -> None:
    """Tensor-parallel ranks exchange activations every layer: they must share a node
    (NVLink), never straddle two. Ray places the actor bundles; refuse a layout where a
    TP group spans hosts rather than run it at network speed (collective)."""
    peers = [None] * dist.get_world_size(tp_group)
    dist.all_gather_object(peers, socket.gethostname(), group=tp_group)
    if len(set(peers)) > 1:
        raise RuntimeError(f"tensor-parallel peers of rank {dist.get_rank()} are on different nodes {sorted(set(peers))}: "
                           f"make openrlhf.actor_gpus_per_node a multiple of megatron.tensor_parallel x "
                           f"pipeline_parallel so each replica's TP group lands on one node")


class MegatronWeightsIO:
    """The Megatron actor's weight sync to the engines and its saves."""

    # --------------------------------------------------------- weight sync
    def broadcast_to_vllm(self) -> None:
        """Stream the weights to the engines one Hugging Face tensor at a time
        (``convert.stream_hf_tensors``: per layer, TP all-gather on the device, PP stages
        send to rank 0; no pickled state dicts, no whole-model copy), each cast to the
        engines' bf16 and sent through OpenRLHF's weight-sync group."""
        from ....megatron.convert import hf_shapes, stream_hf_tensors

        rank0 = dist.get_rank() == 0
        vargs = self.args.vllm
        resets = ([e.reset_prefix_cache.remote() for e in self.vllm_engines]
                  if rank0 and getattr(vargs, "enable_prefix_caching", False) else [])
        use_ray = getattr(vargs, "sync_with_ray", False)
        last = list(hf_shapes(self.hf_config))[-1]

        def send(name: str, t: torch.Tensor) -> None:
            t = t.to(device=device(), dtype=VLLM_DTYPE)
            refs = [e.update_weight.remote(name, dtype=t.dtype, shape=t.shape, empty_cache=name == last)
                    for e in self.vllm_engines]
            if use_ray:
                import ray.util.collective as collective

                collective.broadcast(t, 0, group_name=self._model_update_group)
            else:
                self._model_update_group.broadcast(t, src=0, stream=torch.cuda.current_stream())
            ray.get(refs)

        stream_hf_tensors(self.model, self.hf_config, send)
        if resets:
            ray.get(resets)
        dist.barrier()

    # --------------------------------------------------------- checkpoints
    def _save_hf(self, out: str | Path) -> None:
        """The model in Hugging Face layout at ``out`` (collective; rank 0 writes, atomically,
        from the gathered state dict without building a second model: megatron/hf_save.py)."""
        from ....megatron.convert import gather_hf_state_dict
        from ....megatron.hf_save import save_hf_state_dict

        sd = gather_hf_state_dict(self.model, self.hf_config)
        if dist.get_rank() == 0:
            out = Path(out)
            tmp = out.with_name(out.name + ".tmp")
            # out comes from the user (--save_path, --ckpt.path): replace only what hapo wrote (fsguard)
            remove_owned(out, "the Hugging Face save's directory", check_only=True)  # before the work
            remove_owned(tmp, "the Hugging Face save's temp directory")
            save_hf_state_dict(sd, self.hf_config, self.params_dtype, tmp)
            del sd
            self.tokenizer.save_pretrained(tmp)
            claim(tmp)
            remove_owned(out, "the Hugging Face save's directory")
            os.replace(tmp, out)
        dist.barrier()

    def save_model(self) -> None:
        self._save_hf(self.args.ckpt.output_dir)

    def save_checkpoint(self, tag, client_states=None, metric_value=None, metric_key=None) -> None:
        from ....megatron.checkpoint import save

        m = _TAG.match(tag)
        if not m:
            raise ValueError(f"checkpoint tag {tag!r} is not OpenRLHF's global_stepN / best_global_stepN")
        args = self.args
        root = self.ckpt_root / "best" if m.group(1) else self.ckpt_root
        if not args.ckpt.disable_ds:
            state = {"client_states": dict(client_states or {}),
                     "scheduler": [sched.state_dict() for sched in self.schedulers],
                     "grad_guard": self.grad_guard.state_dict(),
                     "tag": tag, "metric_key": metric_key, "metric_value": metric_value}
            save(root, int(m.group(2)), self.ddp, self.optimizer, trainer_state=state)
            if dist.get_rank() == 0:
                self._prune(root, int(args.ckpt.max_num))
        if args.ckpt.save_hf:
            self._save_hf(Path(args.ckpt.path) / f"{tag}_hf")
        dist.barrier()

    @staticmethod
    def _prune(root: Path, keep: int) -> None:
        found = sorted((int(p.name[5:]), p) for p in root.glob("step_*")
                       if p.is_dir() and p.name[5:].isdigit())
        for _, p in found[:-keep] if keep > 0 else []:
            shutil.rmtree(p, ignore_errors=True)

    def get_checkpoint_states(self) -> dict[str, Any]:
        return self.checkpoint_states
