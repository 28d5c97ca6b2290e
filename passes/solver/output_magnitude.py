"""Among the exact patches, the one that amplifies rounding least (MATH.md 12): pure functions.

Behind an RMS post norm the block gives ``y = v + s' * u / r(u)`` whatever the magnitude
``r(u) = sqrt(mean(u^2) + eps)`` of the MLP output: every magnitude ``R`` of the patched output
``u*`` is an exact patch. Computed in another arithmetic (another summation order, blocking or
kernel: a reload, onnxruntime), ``u*_i = sum_l W'_il a_l`` is off by up to ``gamma * (m_i +
|u*_i|)`` with ``m_i = sum_l |W_il a_l| + |u_i|`` (the down projection's own terms and the
reached output, MATH.md 12), and the post norm passes that on multiplied by ``|s'_i| / R``. The
``|u*_i|`` part gives ``gamma * |t_i|``, the rounding of the output itself; the rest,
``kappa_i = |s'_i| m_i / R``, falls as ``1 / R``. The same ``kappa`` bounds how the branch passes
on a relative perturbation of its input (rounding in the blocks below), so a large one
compounds from block to block. :func:`choose_magnitude` takes the smallest ``R`` (no smaller than
the reached one) at which ``max kappa <= max |t|``, within the dtype's range.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ctxc.passes.solver.multi_scale import SharedScale, shared_scale_targets

__all__ = [
    "MAGNITUDE_CAP",
    "AbsWeights",
    "abs_weight",
    "bank_summed_terms",
    "choose_magnitude",
    "least_rounding_targets",
    "rounding_gain",
    "summed_terms",
]

# At most this many times the reached magnitude: the down projection's delta grows with R, and
# past ~2^10 the gain in rounding is nil (its own terms are then < 1e-3 of the output's).
MAGNITUDE_CAP = 1024.0
_ROWS = 4096  # rows of |W| formed at a time (a 70B down projection is 470 MB)


def summed_terms(
    w: torch.Tensor, h: torch.Tensor, u: torch.Tensor, abs_w: torch.Tensor | None = None
) -> torch.Tensor:
    """``m_ji = sum_l |W_il h_jl| + |u_ji|``: what a linear's output rounding scales with.

    Args:
        w: the linear's weight [out, in] (any float dtype).
        h: its input [k, in].
        u: its output reached [k, out].
        abs_w: ``abs_weight(w)`` when the caller keeps it (the same bits: the same products).

    Returns:
        [k, out], float32.
    """
    ha = h.float().abs()  # [k, in]
    if abs_w is not None:
        parts = [ha @ abs_w[i : i + _ROWS].T for i in range(0, w.shape[0], _ROWS)]
    else:
        parts = [ha @ w[i : i + _ROWS].float().abs().T for i in range(0, w.shape[0], _ROWS)]
    return torch.cat(parts, dim=1) + u.float().abs()  # [k, out]


class AbsWeights:
    """``|W|`` of the weights a caller solves on again and again (``ctxc generate``: every
    token), formed at first use and kept while they fit in ``budget`` bytes.

    Mutable: :meth:`get` fills :attr:`kept`.
    """

    def __init__(self, budget: int) -> None:
        self.budget, self.used = budget, 0
        self.kept: dict[str, torch.Tensor] = {}

    def get(self, name: str, w: torch.Tensor) -> torch.Tensor | None:
        """``abs_weight(w)`` for parameter ``name`` (kept), or None past the budget."""
        if name in self.kept:
            return self.kept[name]
        if self.used + 4 * w.numel() > self.budget:
            return None
        got = abs_weight(w)
        if got is not None:
            self.kept[name] = got
            self.used += 4 * w.numel()
        return got


def abs_weight(w: torch.Tensor) -> torch.Tensor | None:
    """``|W|`` [out, in] in float32: :func:`summed_terms`'s operand, formed once for a caller
    that solves again and again on the same weights (``ctxc generate``).

    None for a weight that is not contiguous (an ``in_out`` layout's transpose): its row blocks'
    ``|W|`` would be laid out unlike the one formed whole, and the products could round apart.
    """
    return w.float().abs() if w.is_contiguous() else None


def bank_summed_terms(
    bank: torch.Tensor,
    layout: str,
    ids: torch.Tensor,
    gates: torch.Tensor,
    h: torch.Tensor,
    tokens: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """:func:`summed_terms` of an MoE's gate-weighted sum over its bank rows.

    Args:
        bank: the experts' output maps [E, out, in] (``out_in``) or [E, in, out] (``in_out``).
        layout: the bank's layout.
        ids: each bank row's expert [rows]; gates: its routing weight [rows];
        h: its activation [rows, in]; tokens: its query position [rows], int64.
        u: the per-token sum reached [k, out].

    Returns:
        ``sum_r |g_r| sum_l |W_e(r),il h_rl| + |u_ji|`` per position [k, out], float32.
    """
    m = u.float().abs().clone()  # [k, out]
    for e in sorted(set(ids.tolist())):
        rows = (ids == e).nonzero().flatten()
        we = bank[e].T if layout == "in_out" else bank[e]  # [out, in]
        terms = summed_terms(we, h[rows], torch.zeros(len(rows), we.shape[0]))  # [n_e, out]
        m.index_add_(0, tokens[rows], gates[rows].float().abs()[:, None] * terms)
    return m


def choose_magnitude(
    gain: torch.Tensor,
    summed: torch.Tensor,
    t: torch.Tensor,
    peak: torch.Tensor,
    dtype: torch.dtype,
    cap: float = MAGNITUDE_CAP,
) -> torch.Tensor:
    """Per position, the factor ``lambda_j >= 1`` on the reached magnitude (MATH.md 12).

    ``lambda_j = max(1, max_i gain_ji m_ji / max_i |t_ji|)``: the smallest factor at which the
    down projection's own rounding, through the post norm, is no larger than the output's own;
    at most ``cap``, and in a dtype of short range (float16) no larger than keeps ``|u*|`` within
    ``sqrt(max)`` (a norm that squares in that dtype must not overflow).

    Args:
        gain: ``|dy_i / du_i|`` at the reached magnitude, ``|s'_i| / R_j`` [k, d] or [d].
        summed: ``m`` [k, d] (:func:`summed_terms`).
        t: the wanted branch outputs [k, d].
        peak: ``max_i |u*_ji|`` at the reached magnitude [k].
        dtype: the model's dtype (where ``u*`` is held).
        cap: the largest factor.

    Returns:
        ``lambda`` [k], float64 (1 where ``t_j = 0``).
    """
    kappa = (gain.double() * summed.double()).amax(dim=-1)  # [k]
    top = t.double().abs().amax(dim=-1)  # [k]
    lam = torch.where(top > 0, kappa / torch.where(top > 0, top, 1.0), 1.0).clamp(1.0, cap)
    big = torch.finfo(dtype).max
    if big < 1e6:  # float16: keep every |u*_i| below sqrt(max), or at the reached peak
        room = (big**0.5 / peak.double().clamp_min(1e-30)).clamp_min(1.0)  # [k]
        lam = torch.minimum(lam, room)
    return torch.nan_to_num(lam, nan=1.0, posinf=cap)


def rounding_gain(
    gain: torch.Tensor, summed: torch.Tensor, t: torch.Tensor, magnitude: Sequence[float] | None
) -> float:
    """The block's figure: ``max_j max_i kappa_ji / max_i |t_ji|`` (MATH.md 12).

    The first-order rounding of the branch output beyond the output's own, per unit roundoff of
    the outer map's sums, relative to its largest output (1: twice the unavoidable at worst).

    Args:
        gain: ``|dy_i / du_i|`` at the reached magnitude [k, d] or [d] (1 without a post norm).
        summed: ``m`` [k, d].
        t: the wanted branch outputs [k, d].
        magnitude: the factors ``lambda_j`` applied (None: 1).

    Returns:
        the figure (0.0 where every ``t_j`` is 0).
    """
    kappa = (gain.double() * summed.double()).amax(dim=-1)  # [k]
    if magnitude is not None:
        kappa = kappa / torch.tensor(list(magnitude), dtype=torch.float64)
    top = t.double().abs().amax(dim=-1)  # [k]
    live = top > 0
    return float((kappa[live] / top[live]).max()) if bool(live.any()) else 0.0


def least_rounding_targets(
    s: torch.Tensor,
    t: torch.Tensor,
    u_now: torch.Tensor,
    rho: torch.Tensor,
    summed: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[SharedScale, torch.Tensor | None]:
    """The least-change shared scale and its targets at the magnitudes of least rounding.

    The scale is solved at the reached magnitudes (MATH.md 9); its gains give
    :func:`choose_magnitude`'s factors (MATH.md 12), and where one is above 1 it is solved
    again at the new magnitudes.

    Args:
        s: the effective scale [d]; t: the wanted products [k, d];
        u_now: the outer output reached [k, d]; rho: ``mean(f_j^2)`` reached [k];
        summed: the outer sums' terms ``m`` [k, d], or None: the reached magnitudes are kept;
        dtype: the model's dtype.

    Returns:
        the :class:`SharedScale`, and the factors [k] (None when ``summed`` is None).
    """
    shared = shared_scale_targets(s, t, u_now, rho)
    if summed is None:
        return shared, None
    r = (u_now.double().pow(2).mean(dim=1) / rho.double()).sqrt()  # [k]: sqrt(M_j + eps)
    gain = shared.scale.double().abs()[None] / r[:, None]  # [k, d]
    peak = shared.targets.abs().amax(dim=1)  # [k]
    lam = choose_magnitude(gain, summed, t, peak, dtype)  # [k]
    if bool((lam > 1).any()):
        shared = shared_scale_targets(s, t, u_now, rho, magnitude=lam)
    return shared, lam
