"""The one arithmetic of a delta: its dense form, the patched value, its low-rank action.

Every place that turns a :class:`~ctxc.patch.Delta` into numbers (the Patch applied to a model,
the solver's reduced pass, the exported graphs) must compute the same ops on the same tensors,
or the emitted model's bits differ from those the solver computed with, and post-norm gains of
1e3 amplify the difference (MATH.md 8). They call these functions.
"""

from __future__ import annotations

import torch

__all__ = ["add_in_float32", "at_alignment_of", "lowrank_action", "lowrank_dense"]

_ALIGN = 64  # bytes: the widest SIMD load the CPU BLAS kernels peel for


def lowrank_dense(u: torch.Tensor, v: torch.Tensor, layout: str) -> torch.Tensor:
    """``u @ v^T`` in the parameter's own layout.

    Args:
        u: [out, r] (or [n, out, r] for n experts of a bank), float32.
        v: [in, r] (or [n, in, r]), float32.
        layout: ``"out_in"`` (``nn.Linear``) or ``"in_out"`` (Conv1D stores ``W^T``).

    Returns:
        [out, in] ([n, out, in]), or its transpose for ``in_out``.
    """
    dw = u @ v.mT  # [out, in] (or [n, out, in])
    return dw.mT if layout == "in_out" else dw


def add_in_float32(base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``(base.float() + delta).to(base.dtype)``: a float32 delta added, rounded once.

    Args:
        base: a parameter or an activation, any float dtype.
        delta: float32, broadcastable to ``base``.

    Returns:
        the sum in ``base``'s dtype.
    """
    return (base.float() + delta).to(base.dtype)


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


def at_alignment_of(value: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``value`` copied into memory with the same address modulo 64 bytes as ``base``.

    CPU BLAS kernels sum in an order that depends on the operand's alignment: the same weights
    at another address give other low bits (measured on Gemma 3 270M: a ``gate_proj`` copy at
    0 mod 64 instead of 56 changes ``F.linear`` by 9.5e-7). A patch applied in place keeps the
    parameter's address (and a reload of the emitted folder reproduces it), so the solver must
    compute with the patched weights at that alignment, or post-norm gains of 1e3 amplify the
    difference (MATH.md 8).
    """
    size = value.element_size()
    want = base.data_ptr() % _ALIGN
    buf = torch.empty(value.numel() + _ALIGN // size, dtype=value.dtype, device=value.device)
    shift = ((want - buf.data_ptr() % _ALIGN) % _ALIGN) // size
    out = buf[shift : shift + value.numel()].view(value.shape)
    out.copy_(value)
    return out
