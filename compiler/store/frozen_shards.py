"""The unpatched weights of an emitted model folder: one file in the cache, hard-linked.

A patch changes the MLP weights and post-norm scales of its blocks; everything else a
``model/`` folder holds (Gemma 3 270M: the 671 MB embedding, the attention, the other norms,
789 of its 1072 MB) is the same bytes at every compile of that model. Written anew each time,
those bytes cost more than the compile itself on a machine whose page cache is slow to fill
(benchmarks/cost/cli.py: the 2-core machine of docs/results/speed.md spends 6-10 s of kernel
time per new GB). A model opted in (:func:`enable`; the command line does it for the models it
loads, which nothing changes) gets its folder written as two shards: the unpatched tensors in
``$CTXC_CACHE/frozen/<key>.safetensors``, written once and hard-linked into every folder, and
the patched ones written fresh. A folder of N contexts then costs the patched bytes N times,
not the whole model.

The key is the model's fingerprint (config, names, shapes, sampled weights) and the shard's
header (names, dtypes, shapes, and its padding: each tensor's address modulo 64 as the model
holds it, so the reloaded weights are read where the solver read them). An entry is trusted
only while its size, inode and modification time are those recorded when it was written
(a sidecar ``<key>.json``): one overwritten through a hard link (``save_pretrained`` into an
emitted folder truncates the file in place) is rewritten, never reused. The entry is stored
read-only. Whatever the entry holds, the emitted folder is still reloaded by plain Transformers
and checked against the full-context reference before it is kept (backends/torch/check.py).
Where a link cannot be made (another file system), the shard is copied. ``CTXC_FROZEN_SHARDS=0``
turns this off: one ``model.safetensors``, as before.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from ctxc.core.cache import cache_dir, partial_entry

__all__ = ["enable", "enabled", "entry_path", "link_or_copy", "stored_entry"]

_ATTR = "ctxc_frozen_shards"
_READ_ONLY = 0o444


def enable(model: torch.nn.Module, on: bool = True) -> None:
    """Let ``emit_torch`` link ``model``'s unpatched weights from the cache (sets an attribute).

    Only for a model whose weights are those it was loaded with: an entry is keyed by a
    sample of them (:func:`~ctxc.models.fingerprint.fingerprint`).
    """
    setattr(model, _ATTR, on)


def enabled(model: torch.nn.Module) -> bool:
    """Whether ``model`` is opted in and the environment does not turn the store off."""
    return bool(getattr(model, _ATTR, False)) and os.environ.get("CTXC_FROZEN_SHARDS") != "0"


def entry_path(key: str) -> Path:
    """Where the entry of ``key`` lives."""
    return cache_dir() / "frozen" / f"{key}.safetensors"


def stored_entry(key: str, size: int, write: Callable[[Path], None]) -> Path:
    """The entry of ``key``: the stored file while it is intact, else written now by ``write``.

    Args:
        key: the entry's key (hex).
        size: the entry's byte count (header and data).
        write: ``write(path)`` writes the entry's bytes at ``path`` (a new file).

    Returns:
        the entry's path (read-only, its sidecar recorded).
    """
    path = entry_path(key)
    if _intact(path, size):
        return path
    with partial_entry(path.parent) as partial:
        write(partial)
        got = partial.stat().st_size
        if got != size:
            raise OSError(f"frozen shard {partial.name}: {got} bytes written, not {size}")
        os.chmod(partial, _READ_ONLY)
        # Atomic, over a read-only file too (rename(2) asks the folder, not the file): a
        # command linking the entry meanwhile finds the old file or the new one, never none.
        os.replace(partial, path)
    st = path.stat()
    record = {"size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}
    sidecar = path.with_suffix(".json")
    tmp = sidecar.with_name(f"{sidecar.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, sidecar)
    return path


def _intact(path: Path, size: int) -> bool:
    """The entry exists as its sidecar recorded it (same size, inode and modification time)."""
    try:
        st = path.stat()
        record = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    seen = {"size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns}
    return isinstance(record, dict) and record == seen and st.st_size == size


def link_or_copy(entry: Path, dest: Path) -> bool:
    """Hard-link ``entry`` at ``dest``; a copy where links are refused. True when linked."""
    try:
        os.link(entry, dest)
        return True
    except OSError:  # another file system, or one without links
        shutil.copyfile(entry, dest)
        return False
