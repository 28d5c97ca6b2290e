"""Checks of a patch's tensors, their digest, and the canonical byte form of a patch file."""

from __future__ import annotations

import hashlib
import json
import struct
from typing import TYPE_CHECKING

import torch

from ctxc.core.errors import CtxcError

if TYPE_CHECKING:
    from ctxc.core.patch import Delta

__all__ = [
    "canonical",
    "check_factors",
    "check_fits",
    "check_tensor",
    "stored_digest",
    "tensors_digest",
]


def check_tensor(key: str, t: torch.Tensor) -> None:
    """A stored factor must be float32 and finite."""
    if t.dtype != torch.float32:
        raise CtxcError(f"tensor {key!r} is {str(t.dtype).removeprefix('torch.')}, not float32")
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        raise CtxcError(f"tensor {key!r} has {bad} non-finite value(s) (NaN or Inf)")


def check_factors(d: Delta, query_tokens: int) -> None:
    """Internal consistency of a delta's factors (without a model).

    Args:
        d: the delta.
        query_tokens: the patch's query length. A solver's delta has rank at most the query
            length per move (or the matrix's own bound, ``min(out, in)``); a larger rank is no
            patch ctxc wrote.
    """
    if d.vector is not None:
        if d.vector.dim() != 1:
            raise CtxcError(f"tensor '{d.param}::vector' has shape {list(d.vector.shape)}, not [d]")
        return
    assert d.u is not None and d.v is not None
    dims = 3 if d.experts else 2
    if d.u.dim() != dims or d.v.dim() != dims:
        raise CtxcError(f"tensors '{d.param}::u'/'::v' are not {dims}-d factors")
    if d.u.shape[-1] != d.v.shape[-1]:
        raise CtxcError(
            f"tensors '{d.param}::u'/'::v' have ranks {d.u.shape[-1]} and {d.v.shape[-1]}"
        )
    if d.experts and not (d.u.shape[0] == d.v.shape[0] == len(d.experts)):
        raise CtxcError(f"tensor '{d.param}::u' does not hold one factor per listed expert")
    rank, bound = d.rank, max(min(d.u.shape[-2], d.v.shape[-2]), query_tokens)
    if not 1 <= rank <= bound:
        raise CtxcError(f"tensor '{d.param}::u' has rank {rank}, outside 1..{bound}")


def check_fits(d: Delta, shape: tuple[int, ...]) -> None:
    """A delta must have its parameter's shape (``shape``: the model's tensor)."""
    if d.vector is not None:
        got: tuple[int, ...] = tuple(d.vector.shape)
    else:
        assert d.u is not None and d.v is not None
        out_in = (int(d.u.shape[-2]), int(d.v.shape[-2]))
        matrix = out_in[::-1] if d.layout == "in_out" else out_in
        if d.experts:
            if len(shape) != 3 or not all(0 <= e < shape[0] for e in d.experts):
                raise CtxcError(f"tensor '{d.param}::u' names experts the parameter lacks")
            got = (shape[0], *matrix)
        else:
            got = matrix
    if got != shape:
        raise CtxcError(
            f"tensor {d.param!r}: delta shape {list(got)} differs from the model's {list(shape)}"
        )


def canonical(data: bytes) -> bytes:
    """A safetensors file with its JSON header in sorted key order (byte-identical per input)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of a patch file's tensors: each name, dtype, shape and bytes, in name order.

    Stored in the file's metadata (``tensors_sha256``) and checked on load: a value changed
    after ctxc wrote it (a bit flip, an edit) is refused, however finite it is.
    """
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        head = [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
        h.update(json.dumps(head).encode() + b"\0")
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def stored_digest(path) -> str | None:
    """The ``tensors_sha256`` a patch file's header holds (None: none), without loading it.

    Raises:
        OSError, ValueError: an unreadable file or header.
    """
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise ValueError(f"{path}: safetensors header of {n} bytes")
        header = json.loads(f.read(n))
    return header.get("__metadata__", {}).get("tensors_sha256")
