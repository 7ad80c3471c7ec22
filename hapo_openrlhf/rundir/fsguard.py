"""Removing a directory only when hapo made it.

Every ``rmtree`` in the project either works on names it derives inside a directory it
owns (checkpoint ``step_N``/``.tmp-*``, ``final_model``: listed in docs/reliability.md) or
goes through :func:`remove_owned`, which deletes a directory only when it carries the
marker hapo writes into what it creates (:func:`claim`), or holds nothing but the files a
Hugging Face model save writes. A symbolic link is never followed; anything else is a
named error and stays as it is. Used where the path comes from the user (the Megatron
actor's Hugging Face saves: OpenRLHF's ``--save_path``, ``--ckpt.path``)."""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

MARKER = ".hapo-owned"
# what save_pretrained (model + tokenizer) writes; a directory of only these is a model save
HF_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
            "pytorch_model*.bin", "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt",
            "added_tokens.json", "chat_template.jinja", MARKER)


def claim(d: str | Path) -> None:
    """Mark directory ``d`` as created by hapo (so :func:`remove_owned` may replace it)."""
    (Path(d) / MARKER).write_text("written by hapo-openrlhf; may be replaced by its next save\n")


def _is_model_save(d: Path) -> bool:
    return all(f.is_file() and not f.is_symlink() and any(fnmatch.fnmatch(f.name, p) for p in HF_FILES)
               for f in d.iterdir())


def remove_owned(d: str | Path, what: str, check_only: bool = False) -> None:
    """Delete ``d`` if it is absent, an empty directory, marked by :func:`claim`, or a
    Hugging Face model save; else ``ValueError`` naming it (``what`` says what it is for).
    ``check_only``: raise as above, delete nothing (to fail before expensive work)."""
    d = Path(d)
    if d.is_symlink():
        raise ValueError(f"{what} {d} is a symbolic link; refusing to replace it (it could point anywhere). "
                         f"Remove the link or choose another path")
    if not d.exists():
        return
    if not d.is_dir():
        raise ValueError(f"{what} {d} exists and is not a directory; refusing to replace it. Move it aside")
    if not ((d / MARKER).is_file() or _is_model_save(d)):
        raise ValueError(f"{what} {d} exists and holds files hapo did not write (no {MARKER}, not only a model "
                         f"save); refusing to delete it. Move it aside or choose another path")
    if not check_only:
        shutil.rmtree(d)
