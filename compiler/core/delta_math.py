"""The one arithmetic of a delta: its dense form, the patched value, its low-rank action.

Every place that turns a :class:`~ctxc.patch.Delta` into numbers (the Patch applied to a model,
the solver's reduced pass, the exported graphs) must compute the same ops on the same tensors,
or the emitted model's bits differ from those the solver computed with, and post-norm gains of
1e3 amplify the difference (MATH.md 8). They call these functions.
"""

from __future__ import annotations

import torch

__all__ = [
    "add_in_float32",
    "aligned_empty_like",
    "at_alignment_of",
    "lowrank_action",
    "lowrank_dense",
]

_ALIGN = 64  # bytes: the widest SIMD load the CPU BLAS kernels peel for


def lowrank_dense(
    u: torch.Tensor, v: torch.Tensor, layout: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``u @ v^T`` in the parameter's own layout.

    Args:
        u: [out, r] (or [n, out, r] for n experts of a bank), float32.
        v: [in, r] (or [n, in, r]), float32.
        layout: ``"out_in"`` (``nn.Linear``) or ``"in_out"`` (Conv1D stores ``W^T``).
        out: a contiguous float32 [out, in] buffer allocated as ``torch.empty`` allocates (the
            same kernel, the same bits: ``BufferPool.take_new``), or None.

    Returns:
        [out, in] ([n, out, in]), or its transpose for ``in_out``.
    """
    dw = torch.matmul(u, v.mT, out=out) if out is not None else u @ v.mT  # [out, in]
    return dw.mT if layout == "in_out" else dw


def add_in_float32(
    base: torch.Tensor, delta: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``(base.float() + delta).to(base.dtype)``: a float32 delta added, rounded once.

    Args:
        base: a parameter or an activation, any float dtype.
        delta: float32, broadcastable to ``base``.
        out: where to write the sum (``base``'s shape and dtype: :func:`aligned_empty_like`),
            the same bits as without it, one copy of the tensor fewer.

    Returns:
        the sum in ``base``'s dtype (``out`` when given).
    """
    if out is None:
        return (base.float() + delta).to(base.dtype)
    if base.dtype == torch.float32:
        return torch.add(base, delta, out=out)  # the same elementwise add, written in place
    return out.copy_(base.float() + delta)  # copy_ rounds to out's dtype as .to() does


def lowrank_action(x: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``(x v) u^T``: what ``dW = u v^T`` adds to a linear's output, without forming ``dW``.

    Args:
        x: the linear's input [k, in] (or [in]), float32.
        u: [out, r], float32.
        v: [in, r], float32.

    Returns:
        [k, out] (or [out]), float32.
    """
    return (x @ v) @ u.mT


def aligned_empty_like(base: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``base``'s shape and dtype at its address modulo 64 bytes
    (see :func:`at_alignment_of`), contiguous: a patched value computed into it needs no copy."""
    return _empty_at(base.data_ptr(), base.shape, base.dtype, base.device)


def _empty_at(address: int, shape: torch.Size, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised contiguous tensor whose data sits at ``address`` modulo 64 bytes."""
    size = dtype.itemsize
    numel = shape.numel()
    buf = torch.empty(numel + _ALIGN // size, dtype=dtype, device=device)
    shift = ((address % _ALIGN - buf.data_ptr() % _ALIGN) % _ALIGN) // size
    return buf[shift : shift + numel].view(shape)


def at_alignment_of(value: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``value`` copied into memory with the same address modulo 64 bytes as ``base``.

    CPU BLAS kernels sum in an order that depends on the operand's alignment: the same weights
    at another address give other low bits (measured on Gemma 3 270M: a ``gate_proj`` copy at
    0 mod 64 instead of 56 changes ``F.linear`` by 9.5e-7). A patch applied in place keeps the
    parameter's address (and a reload of the emitted folder reproduces it), so the solver must
    compute with the patched weights at that alignment, or post-norm gains of 1e3 amplify the
    difference (MATH.md 8).
    """
    return _empty_at(base.data_ptr(), value.shape, value.dtype, value.device).copy_(value)
