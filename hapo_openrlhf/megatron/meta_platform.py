"""What megatron-core needs to build a model, its DDP wrapper and its optimizer on the meta
device under torch's fake process group: the full-size dry run's platform (:mod:`.dryrun`).

megatron-core asks for "the current CUDA device" and allocates some buffers with
``device="cuda"``; here both mean ``meta`` (shapes and dtypes, no storage). Every patch is
undone when :func:`meta_platform` exits; the dry run runs in its own process all the same
(``hapo doctor`` starts it as a child), since megatron-core keeps global state. Nothing here
is used when training. The CPU test shim (tests/megatron/cuda_shim.py) reuses
:class:`NullStream` and :class:`TorchOnDevice` with ``cpu``.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch

META = torch.device("meta")


class NullStream:
    """A CUDA stream where work is synchronous: nothing to wait for."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return self  # an event that has already happened: wait() / synchronize() return at once

    def wait(self, stream=None) -> None:
        pass


def _is_cuda(device: Any) -> bool:
    return device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda")


class TorchOnDevice(types.ModuleType):
    """``torch`` for one module's namespace, with ``zeros / tensor / empty (..., device="cuda")``
    on :attr:`target` instead (a subclass sets it)."""

    target: Any = "cpu"

    def __getattr__(self, name):
        return getattr(torch, name)

    def _to(self, device):
        return self.target if _is_cuda(device) else device

    def zeros(self, *args, device=None, **kwargs):
        return torch.zeros(*args, device=self._to(device), **kwargs)

    def tensor(self, *args, device=None, **kwargs):
        return torch.tensor(*args, device=self._to(device), **kwargs)

    def empty(self, *args, device=None, **kwargs):
        return torch.empty(*args, device=self._to(device), **kwargs)


def torch_on(target: Any) -> TorchOnDevice:
    mod = TorchOnDevice("torch")
    mod.target = target
    return mod


@contextlib.contextmanager
def meta_platform() -> Iterator[None]:
    """megatron-core on the meta device: CUDA's current device, streams and ``device="cuda"``
    allocations become meta; a parameter's ``type()`` reads as the CUDA type megatron-core's
    optimizer accepts; the gloo groups it makes beside each NCCL group are made on the world's
    own (fake) backend, which cannot build gloo. Restores everything on exit."""
    import torch.distributed as dist
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    saved: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    real_type, real_new_group = torch.Tensor.type, dist.new_group

    def cuda_type(self, *args, **kwargs):
        if args or kwargs:
            return real_type(self, *args, **kwargs)
        return real_type(self).replace("torch.meta.", "torch.", 1).replace("torch.", "torch.cuda.", 1)

    def new_group(*args, backend=None, **kwargs):  # every group on the fake backend
        return real_new_group(*args, **kwargs)

    try:
        patch(torch.cuda, "current_device", lambda: META)
        patch(torch.cuda, "Stream", NullStream)
        patch(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
        patch(torch.cuda, "current_stream", lambda *a, **k: NullStream())
        patch(torch.cuda, "synchronize", lambda *a, **k: None)
        patch(torch.Tensor, "type", cuda_type)
        patch(dist, "new_group", new_group)
        for mod in (optimizer, clip_grads, distrib_optimizer, utils):
            patch(mod, "torch", torch_on(META))
        from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

        # YaRN's cos/sin cache, built at construction, is cut per CP rank with an index made in pinned
        # host memory, which needs CUDA: the same cut with the index on the embedding's device
        patch(yarn, "get_pos_emb_on_this_cp_rank", _cp_rank_slice)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _cp_rank_slice(pos_emb, seq_dim, cp_group):
    """megatron-core's ``rope_utils.get_pos_emb_on_this_cp_rank`` (chunks r and 2 CP - 1 - r of the
    sequence dimension), its index on ``pos_emb``'s device instead of pinned host memory."""
    cp, r = cp_group.size(), cp_group.rank()
    idx = torch.tensor([r, 2 * cp - r - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])
