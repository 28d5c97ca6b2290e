"""Attention under a boolean mask, computed only where the mask lets a query see a key.

The exported graph materialises every attention mask as a boolean ``[b, 1, n, n]`` tensor and
calls ``scaled_dot_product_attention`` with it: the CPU kernel then reads all ``n^2`` scores,
though a sliding-window layer (Gemma 3: 512 keys) sees a band of them and a causal one half.
Over a long context that is most of a full run's time (at 8k tokens, attention outweighs the
linears of Gemma 3 270M). :func:`banded_sdpa` splits the queries into chunks and gives each
chunk the keys its rows can see, widened to whole kernel blocks of ``KEY_BLOCK`` keys.

It computes the same numbers as the whole call, bit for bit, on the CPU flash kernel (measured:
``tests/passes/runtime/test_banded_attention.py``): the kernel handles each query row on its own,
over key blocks of 512 in order with an online softmax, and a key block that is masked for every row
of a chunk adds exactly nothing (its scores are ``-inf``: probabilities 0, running maximum and sum
unchanged, rescale factor ``exp(0) = 1``). The key ranges start and end on the kernel's block
boundaries, so the blocks that remain are the same blocks, and chunks are whole 256-row query blocks
of at least 768 rows (the kernel's split heuristics keep the same block sizes there).
On other devices the kernels differ: :func:`banded_sdpa` is used on the CPU only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["KEY_BLOCK", "QUERY_CHUNK", "Band", "banded_sdpa", "mask_bands", "sdpa_call", "usable"]

# Keys per block of the CPU flash-attention kernel (aten/src/ATen/native/cpu/
# FlashAttentionKernel.cpp: kvSplitSize = 512 for float32); key ranges are cut on these bounds.
KEY_BLOCK = 512
# Query rows per chunk: a multiple of the kernel's 256-row query blocks, and the shortest chunk
# is kept at 768 rows or more (below that the kernel picks smaller query blocks).
QUERY_CHUNK = 1024
_MIN_CHUNK = 768


@dataclass(frozen=True)
class Band:
    """One query chunk and the keys it reads.

    Attributes:
        rows: query rows ``[start, stop)``.
        keys: key positions ``[start, stop)``, on :data:`KEY_BLOCK` boundaries (or ``n``).
    """

    rows: tuple[int, int]
    keys: tuple[int, int]


def usable(q: torch.Tensor, mask: object, dropout_p: float, is_causal: bool) -> bool:
    """Whether :func:`banded_sdpa` computes this call exactly: a CPU call with a boolean mask
    ``[..., n_q, n_k]``, no dropout, no ``is_causal``, and more rows than one chunk."""
    return (
        isinstance(mask, torch.Tensor)
        and mask.dtype == torch.bool
        and mask.dim() >= 2
        and q.device.type == "cpu"
        and mask.device.type == "cpu"
        and dropout_p == 0.0
        and not is_causal
        and q.shape[-2] == mask.shape[-2]
        and q.shape[-2] >= QUERY_CHUNK + _MIN_CHUNK
    )


def _chunks(n: int) -> list[tuple[int, int]]:
    """``[start, stop)`` query chunks of :data:`QUERY_CHUNK` rows; the last takes the rest and
    the one before when the rest is under 768 rows."""
    starts = list(range(0, n, QUERY_CHUNK))
    if len(starts) > 1 and n - starts[-1] < _MIN_CHUNK:
        starts.pop()
    return list(zip(starts, [*starts[1:], n], strict=True))


def mask_bands(mask: torch.Tensor) -> tuple[Band, ...]:
    """The key range each query chunk can see under ``mask``.

    Args:
        mask: bool [..., n_q, n_k] (True: the query attends to the key), broadcast dims
            included; read one chunk of rows at a time.

    Returns:
        one :class:`Band` per chunk. A chunk that sees no key at all keeps every key (the whole
        call's result for such rows, whatever the kernel makes of them).
    """
    n_k = mask.shape[-1]
    bands = []
    for r0, r1 in _chunks(mask.shape[-2]):
        seen = mask[..., r0:r1, :].reshape(-1, n_k).any(dim=0)  # [n_k]
        cols = seen.nonzero()
        if cols.numel() == 0:
            bands.append(Band((r0, r1), (0, n_k)))
            continue
        first, last = int(cols[0]), int(cols[-1])
        k0 = first // KEY_BLOCK * KEY_BLOCK
        k1 = min(n_k, -(-(last + 1) // KEY_BLOCK) * KEY_BLOCK)
        bands.append(Band((r0, r1), (k0, k1)))
    return tuple(bands)


def banded_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    bands: tuple[Band, ...],
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention(q, k, v, attn_mask=mask)``, chunk by chunk over ``bands``.

    Args:
        q: [b, h, n_q, e] queries.
        k: [b, h_kv, n_k, e] keys.
        v: [b, h_kv, n_k, e_v] values.
        mask: bool [..., n_q, n_k], as the whole call takes it.
        bands: :func:`mask_bands` of ``mask``.
        scale, enable_gqa: as ``scaled_dot_product_attention`` takes them.

    Returns:
        [b, h, n_q, e_v], equal to the whole call's result (see the module's docstring).
    """
    out = []
    for band in bands:
        (r0, r1), (k0, k1) = band.rows, band.keys
        out.append(
            F.scaled_dot_product_attention(
                q[..., r0:r1, :],  # [b, h, rows, e]
                k[..., k0:k1, :],  # [b, h_kv, keys, e]
                v[..., k0:k1, :],
                attn_mask=mask[..., r0:r1, k0:k1],  # [..., rows, keys]
                scale=scale,
                enable_gqa=enable_gqa,
            )
        )
    return torch.cat(out, dim=-2)  # [b, h, n_q, e_v]


_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_ARGS = tuple(a.name for a in _SDPA._schema.arguments)
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None}


def sdpa_call(target: object, args: tuple, kwargs: dict) -> dict | None:
    """The arguments of an ``aten.scaled_dot_product_attention`` call by name, or None when
    ``target`` is another op.

    Args:
        target: a graph node's target.
        args, kwargs: the node's argument values.

    Returns:
        ``{"query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", ...}``.
    """
    if target is not _SDPA:
        return None
    return {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
