"""Refuse a Megatron (torch DCP) checkpoint that would run code when it is loaded.

megatron-core's ``torch_dist`` format is PyTorch Distributed Checkpoint. DCP reads a
checkpoint's ``.metadata`` with plain ``pickle.load`` (``FileSystemReader.read_metadata``)
and each non-tensor entry stored in the ``.distcp`` files with
``torch.load(weights_only=False)`` (``DefaultLoadPlanner.load_bytes``): a planted file can
run anything on resume. megatron-core 0.16.1 reads ``common.pt`` with PyTorch's default,
``weights_only=True``, which is already safe.

:func:`scan` reads, before megatron-core does, the same bytes with restricted unpicklers:

* ``.metadata``: only *data* classes may be built -- dataclasses and enums of
  ``torch.distributed.checkpoint``, ``torch.distributed._shard`` and
  ``megatron.core.dist_checkpointing`` (DCP's ``Metadata``, ``TensorStorageMetadata``,
  ``_StorageInfo``, megatron's ``MCoreMetadata``, ...), ``torch.Size``, dtypes, layouts and
  memory formats, ``pathlib.PosixPath`` (the checkpoint id), ``collections.OrderedDict``. A function (``os.system``,
  ``builtins.eval``) or any other class is refused by name.
* every byte entry the metadata lists: read from its ``.distcp`` file at its offset and
  loaded with PyTorch's ``weights_only`` unpickler (the project's ``safe_torch_load``
  rules: tensors, plain data, numeric numpy arrays).

Nothing is executed; the scan costs one pass over the metadata and the (small) byte
entries, not over the tensor shards.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from pathlib import Path

import torch

_DATA_MODULES = ("torch.distributed.checkpoint", "torch.distributed._shard", "megatron.core.dist_checkpointing")
# besides those: what DCP's own metadata pickles (torch.Size, a layout by name, the
# checkpoint_id as a path) and harmless builtins
_EXACT = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
          ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"), ("copyreg", "_reconstructor"),
          ("builtins", "object"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        obj = super().find_class(module, name)
        if (module, name) in _EXACT:
            return obj
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
        if module.startswith(_DATA_MODULES) and isinstance(obj, type) and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
        raise pickle.UnpicklingError(f"global {module}.{name} is not a checkpoint data class")


def _read_metadata(d: Path):
    with open(d / ".metadata", "rb") as f:
        return _MetadataUnpickler(f).load()


def scan(d: str | Path) -> str | None:
    """None when loading ``d`` cannot run code; otherwise why it could (for the skip message)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from ..rundir.checkpoint import _numpy_globals

    d = Path(d)
    if not (d / ".metadata").is_file():
        return None  # not a DCP checkpoint: megatron-core refuses it itself
    try:
        md = _read_metadata(d)
    except Exception as e:  # noqa: BLE001 - any failure to read it safely means: do not load it
        return f".metadata holds objects other than checkpoint data and is not loaded (loading it could run " \
               f"code): {str(e).splitlines()[0][:200] if str(e) else 'unreadable'}"
    entries = getattr(md, "state_dict_metadata", None)
    storage = getattr(md, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return ".metadata is not DCP checkpoint metadata (no state_dict_metadata / storage_data)"
    for fqn, meta in entries.items():
        if not isinstance(meta, BytesStorageMetadata):
            continue
        info = storage.get(MetadataIndex(fqn))
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in Path(rel).parts:
            return f"the entry {fqn!r} points outside the checkpoint ({rel!r})"
        try:
            with open(d / rel, "rb") as f:
                f.seek(int(info.offset))
                raw = f.read(int(info.length))
            with torch.serialization.safe_globals(_numpy_globals()):
                torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            return f"the entry {fqn!r} in {rel} holds objects other than tensors and plain data, and is not " \
                   f"loaded (loading it could run code): {str(e).strip().splitlines()[0][:200]}"
        except Exception as e:  # noqa: BLE001 - truncated or unreadable: megatron-core could not load it either
            return f"the entry {fqn!r} in {rel} is unreadable ({str(e).splitlines()[0][:200] if str(e) else e!r})"
    return None

