"""The saved shards of a dispersed model, rewritten so each patched weight keeps its alignment.

CPU BLAS kernels round differently at another address modulo 64 bytes, and the solver computed
each patched weight at the address the model held it (``at_alignment_of``; README, Precision). A
model loaded from safetensors is memory-mapped: a tensor's address modulo 64 is
``8 + header length + its data offset`` modulo 64. Saved as one file like its source, the
emitted model reproduces those addresses; saved shard by shard it does not (Gemma 3 270M:
1.8e-4 instead of 3.1e-6). Padding a shard's header with spaces (which the safetensors format
allows) shifts every tensor of the shard: each shard gets the shift most of its patched
weights need (``ctxc.offload.pad_header``; the file is copied, never read whole).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from ctxc.offload import pad_header, safetensors_header, store_file

__all__ = ["realign_shards", "source_alignments"]

_ALIGN = 64


def source_alignments(model: torch.nn.Module, names) -> dict[str, int]:
    """Address modulo 64 of each named CPU or offloaded parameter as the solver read it."""
    out: dict[str, int] = {}
    for name in names:
        param = model.get_parameter(name)
        if param.device.type == "cpu":
            out[name] = param.data_ptr() % _ALIGN
            continue
        found = store_file(model, name)
        if found is not None:
            n, header = safetensors_header(found[0])
            out[name] = (8 + n + header[found[1]]["data_offsets"][0]) % _ALIGN
    return out


def realign_shards(folder: Path, wanted: dict[str, int]) -> int:
    """Pad the header of every shard in ``folder`` so its patched weights sit at ``wanted``.

    Args:
        folder: a saved model folder (``*.safetensors``).
        wanted: parameter name -> address modulo 64 it was solved at.

    Returns:
        the number of files rewritten. Side effect: those files are replaced.
    """
    rewritten = 0
    for path in sorted(folder.glob("*.safetensors")):
        n, header = safetensors_header(str(path))
        shifts = Counter(
            (wanted[k] - 8 - n - v["data_offsets"][0]) % _ALIGN
            for k, v in header.items()
            if k in wanted
        )
        if not shifts:
            continue
        pad = shifts.most_common(1)[0][0]
        if pad == 0:
            continue
        pad_header(str(path), pad)
        rewritten += 1
    return rewritten
