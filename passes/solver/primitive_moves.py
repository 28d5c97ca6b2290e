"""The primitive moves of MATH.md 1 and 4, as pure float32 tensor functions.

Rows are query positions: ``Z`` is [k, d_in] for k query tokens. A matrix delta is returned as
factors ``(u, v)`` with ``dW = u @ v.T`` in ``[out, in]`` orientation. Each function checks the
condition its formula needs and raises :class:`ConditionError` with the offending value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxc.passes.solver.rms_inversion import nearest_unit_rms

__all__ = [
    "SCALE_FLOOR",
    "ConditionError",
    "ScaleMove",
    "input_move",
    "linear_output_move",
    "right_inverse",
    "scale_output_move",
    "stable_post_norm_target",
]

# |s| below this is floored when fitting the stable rule (MATH.md 8: Gemma 3 270M's post-FFN
# scales are exactly 0 at 9 coordinates; the true s stays in the residual).
SCALE_FLOOR = 0.1


class ConditionError(ValueError):
    """A condition the patch maths needs does not hold (zero norm, zero divisor)."""


def right_inverse(x: torch.Tensor, what: str) -> torch.Tensor:
    """``X^+`` for ``X`` [k, d] of full row rank, as [d, k]: ``X @ X^+ = I_k``.

    Raises:
        ConditionError: ``X`` is zero (k = 1) or its rows are linearly dependent.
    """
    x = x.float()
    if x.shape[0] == 1:
        sq = float(x.pow(2).sum())
        if sq == 0.0:
            raise ConditionError(
                f"{what} is zero (||{what}||^2 = 0): the rank-1 move divides by it"
            )
        return x.T / sq  # [d, 1]
    sv = torch.linalg.svdvals(x.double())
    if float(sv[-1]) <= 1e-7 * float(sv[0]):
        raise ConditionError(
            f"{what} rows are linearly dependent (singular values {float(sv[0]):.3g} .. "
            f"{float(sv[-1]):.3g}): no exact rank-{x.shape[0]} move"
        )
    return torch.linalg.pinv(x.double()).float()  # [d, k]


def input_move(
    w: torch.Tensor, z: torch.Tensor, z_target: torch.Tensor, z_pinv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors of ``dW`` with ``(W + dW) z = W z_target`` at every query position.

    Args:
        w: weight [out, in] (any dtype; used in float32).
        z: reached input [k, in].
        z_target: wanted input [k, in] (the full run's).
        z_pinv: ``right_inverse(z)`` [in, k], shared by every linear that reads ``z``.

    Returns:
        ``(u, v)``: u [out, k], v [in, k], float32.
    """
    dz = z_target.float() - z.float()  # [k, in]
    u = (dz @ w.float().T).T  # [out, k]
    return u.contiguous(), z_pinv.contiguous()


def linear_output_move(
    residual: torch.Tensor, h: torch.Tensor, h_pinv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors of ``dW_out`` adding ``residual`` to the outer linear's output.

    Args:
        residual: wanted change of the linear's output [k, out].
        h: the linear's input [k, in] (only for shape checks).
        h_pinv: ``right_inverse(h)`` [in, k].

    Returns:
        ``(u, v)``: u [out, k], v [in, k], float32.
    """
    assert residual.shape[0] == h.shape[0]
    return residual.float().T.contiguous(), h_pinv.contiguous()


@dataclass(frozen=True)
class ScaleMove:
    """A scale change ``ds`` and the figures that say how hard it was.

    Attributes:
        ds: change of the effective scale ``s`` [d], float32.
        min_divisor: smallest ``|f_i|`` divided by.
        max_change: largest ``|ds_i|``.
        max_gain: largest ``|s_i + ds_i|``.
        unreached: coordinates a low-precision zero ``f_i`` left unreached.
        max_unreached: the largest change such a coordinate missed.
        magnitude: the largest factor on the reached MLP output's magnitude (MATH.md 12).
        rounding_gain: the block's first-order rounding figure (MATH.md 12), or None.
    """

    ds: torch.Tensor
    min_divisor: float
    max_change: float
    max_gain: float
    unreached: int = 0
    max_unreached: float = 0.0
    magnitude: float = 1.0
    rounding_gain: float | None = None


def scale_output_move(
    s: torch.Tensor,
    f: torch.Tensor,
    t: torch.Tensor,
    tol: torch.Tensor | None = None,
    allow_unreached: bool = False,
) -> ScaleMove:
    """``ds = (t - s * f) / f``: the scale change making ``(s + ds) * f = t``.

    Args:
        s: current effective scale [d], float32.
        f: normalised activation actually reached [d] (the output the patched MLP produces).
        t: wanted product [d].
        tol: per-coordinate change [d] too small to matter (below the output dtype's spacing);
            default 0.

    Raises:
        ConditionError: ``f_i = 0`` where ``|t_i - s_i f_i| > tol_i`` (unreachable coordinate),
            unless ``allow_unreached``: then ``ds_i = 0`` there and the miss is counted (in low
            precision a zero ``f_i`` is rounding, and the next block absorbs the miss).
    """
    s, f, t = s.float(), f.float(), t.float()
    r = t - s * f  # [d]
    zero = f == 0
    bad = zero & (r.abs() > (0.0 if tol is None else tol))
    if bool(bad.any()) and not allow_unreached:
        i = int(torch.nonzero(bad)[0])
        raise ConditionError(
            f"normalised MLP output is exactly 0 at {int(bad.sum())} coordinate(s) (first: {i}, "
            f"needed change {float(r[i]):.3g}): the scale cannot reach it"
        )
    ds = torch.where(zero, torch.zeros_like(r), r / torch.where(zero, torch.ones_like(f), f))
    if not bool(torch.isfinite(ds).all()):
        raise ConditionError("scale change is not finite (|f| underflows)")
    nz = f[~zero].abs()
    return ScaleMove(
        ds=ds,
        min_divisor=float(nz.min()) if nz.numel() else 0.0,
        max_change=float(ds.abs().max()),
        max_gain=float((s + ds).abs().max()),
        unreached=int(bad.sum()),
        max_unreached=float(r[bad].abs().max()) if bool(bad.any()) else 0.0,
    )


def stable_post_norm_target(s: torch.Tensor, t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The outer-linear output ``u*`` whose RMS-normalised form, scaled by ``s``, is nearest ``t``.

    MATH.md 4: ``w`` = nearest unit-RMS vector with ``s_fit * w ~ t`` (``|s|`` floored at
    :data:`SCALE_FLOOR`), ``u* = rms(u) * w`` so the magnitude stays that of the reached output.

    Args:
        s: current effective scale [d].
        t: wanted branch output [d].
        u: outer linear output reached [d].

    Returns:
        ``u*`` [d], float32.
    """
    s = s.double()
    sign = torch.where(s < 0, -torch.ones_like(s), torch.ones_like(s))
    s_fit = sign * s.abs().clamp_min(SCALE_FLOOR)  # [d]
    w = nearest_unit_rms(s_fit, t.double()).w  # [d]
    rms = u.double().pow(2).mean().sqrt()
    return (rms * w).float()
