"""The shared-scale dual's starting point (MATH.md 9): each position's own multiplier.

:func:`~ctxc.passes.solver.multi_scale.shared_scale_targets` starts its Newton solve from each
query position's own multiplier: the root of ``F_j(lam) = sum_i t_ji^2 q_i(a_i^2 - lam) = b_j``,
a secular equation (``F_j`` rises from 0 to a pole at the smallest ``a_i^2`` the position
needs). For one query position (``ctxc generate``'s every step) that root is the answer.

It was found by bisection, 120 halvings (five levels per batched call): at one token per step
the largest part of the solver's time (issue 33: 13% of a generate step's solve, Python
overhead on [1, 31, 640] tensors). Here it is Newton's method on ``1 / F_j - 1 / b_j``, the
classic form for a secular equation (Moré and Sorensen 1983, "Computing a trust region step";
near a dominant pole ``1 / F`` is almost linear, so Newton's step lands almost on the root),
kept inside a bracket that every evaluation narrows (a step that leaves it is a halving
instead): 5-10 evaluations where the bisection took 50-65 halvings. It stops when ``F_j`` is
``b_j`` to the double's resolution or the bracket stops moving; the start is then a root to
about 1e-15, where the bisection's was the left end of its last interval.
Analysis: nothing is mutated.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["MAX_STEPS", "own_multipliers"]

MAX_STEPS = 200  # evaluations at most (halvings alone would reach the double's end in ~1100)
_RESOLUTION = 4e-16  # |F - b| / b at which a root is taken (two ulps of b)
_ULPS = 4  # a Newton correction of at most this many ulps of lambda is rounding: converged
_EPS = 2.0**-52  # the double's epsilon (the solve is in float64)


def own_multipliers(
    tt: torch.Tensor,
    b: torch.Tensor,
    a2: torch.Tensor,
    q_of: Callable[[torch.Tensor], torch.Tensor],
    dq_of: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Each position's own multiplier, as if it were alone (``mu_i = lambda_j`` everywhere): a
    point of the dual's domain (``mu_i`` averages them) near the optimum, exact for k = 1.

    Args:
        tt: squared targets [k, n]; b: right-hand sides [k]; a2: floored squared scales [n];
        q_of: ``gap [.., n] -> q`` element-wise, falling as ``gap`` grows;
        dq_of: ``gap -> -dq/dgap``, the slope of ``q`` in ``lambda`` (``gap = a2 - lambda``).

    Returns:
        ``lambda`` [k], float64, below each position's pole.
    """
    big = tt > 0  # [k, n]
    inf = torch.full_like(tt, math.inf)
    top_t = torch.where(big, a2.expand_as(tt), inf).amin(dim=1)  # [k]: pole of each position

    def at(lam: list[float]) -> tuple[list[float], list[float]]:
        """F and dF/dlambda at each position's lambda: one batched evaluation, one sync."""
        if len(lam) == 1:  # ``ctxc generate``'s every step: no [k, n] batch to build
            # A [n] sum is the [1, n] row's, bit for bit (the same inner reduction).
            gap1 = a2 - lam[0]  # [n]
            return [float((tt[0] * q_of(gap1)).sum())], [float((tt[0] * dq_of(gap1)).sum())]
        gap = a2 - torch.tensor(lam, dtype=tt.dtype, device=tt.device)[:, None]  # [k, n]
        f = (tt * q_of(gap)).sum(dim=1)  # [k]
        slope = (tt * dq_of(gap)).sum(dim=1)  # [k]
        both = torch.stack([f, slope]).tolist()
        return both[0], both[1]

    top, rhs = top_t.tolist(), b.tolist()
    k = len(top)
    lo = [t - 1.0 for t in top]
    f_lo, slope_lo = at(lo)
    for _ in range(200):  # widen until the left end is under the target (F rises with lambda)
        over = [j for j in range(k) if f_lo[j] > rhs[j]]
        if not over:
            break
        lo = [top[j] - 4.0 * (top[j] - lo[j]) if j in over else lo[j] for j in range(k)]
        f_lo, slope_lo = at(lo)
    # Each position's bracket [lo, hi] (F(lo) <= b < F(hi); hi starts at the pole) and its
    # current point, the last one evaluated: (lambda, F, dF/dlambda).
    hi, f_hi = list(top), [math.inf] * k
    cur = list(zip(lo, f_lo, slope_lo, strict=True))
    done = [False] * k
    for _ in range(MAX_STEPS):
        new = []
        for j in range(k):
            if not done[j]:
                lam, f, slope = cur[j]
                step = _next(lam, f, slope, rhs[j], top[j], (lo[j], f_lo[j]), (hi[j], f_hi[j]))
                if step is None:  # converged
                    done[j] = True
                else:
                    new.append((j, step))
        if not new:
            break
        lams = [lam for lam, _, _ in cur]
        for j, step in new:
            lams[j] = step
        f_all, slope_all = at(lams)
        for j, step in new:
            f, slope = f_all[j], slope_all[j]
            cur[j] = (step, f, slope)
            if f <= rhs[j]:
                lo[j], f_lo[j] = step, f
            else:
                hi[j], f_hi[j] = step, f
            if abs(f - rhs[j]) <= _RESOLUTION * rhs[j]:
                done[j] = True
    # The bracket's end nearer the root (the right one only where it is not the pole).
    ends = zip(lo, f_lo, hi, f_hi, rhs, strict=True)
    out = [x_hi if abs(fh - r) < abs(fl - r) else x_lo for x_lo, fl, x_hi, fh, r in ends]
    return torch.tensor(out, dtype=tt.dtype, device=tt.device)


def _next(
    lam: float,
    f: float,
    slope: float,
    b: float,
    top: float,
    lo: tuple[float, float],
    hi: tuple[float, float],
) -> float | None:
    """One position's next point, or None when converged.

    Newton on ``ln F`` against ``u = ln(top - lambda)``: near the pole and far from it
    ``ln F`` is about linear in ``u`` (``F ~ w / d^p``), so the step lands near the root from
    anywhere in the bracket. A step that leaves the bracket is the secant of ``ln F`` against
    ``u`` through its ends instead, or, while the right end is the pole itself, a step 8 bits
    closer to it; failing that, the midpoint. Converged: Newton's correction is within
    :data:`_ULPS` ulps of ``lambda``, or the point would not move.
    """
    (x_lo, f_lo), (x_hi, f_hi) = lo, hi
    d = top - lam
    try:
        step = top - d * math.exp((math.log(f) - math.log(b)) * f / (d * slope))
    except (ValueError, OverflowError, ZeroDivisionError):
        step = math.nan
    if abs(step - lam) <= _ULPS * _EPS * abs(lam):
        return None
    if not x_lo < step < x_hi:
        if math.isfinite(f_hi):
            u_lo, u_hi = math.log(top - x_lo), math.log(top - x_hi)
            t = (math.log(b) - math.log(f_lo)) / (math.log(f_hi) - math.log(f_lo))
            step = top - math.exp(u_lo + t * (u_hi - u_lo))
        else:
            step = top - (top - x_lo) / 256.0
        if not x_lo < step < x_hi:
            step = 0.5 * (x_lo + x_hi)
    return None if step in (lam, x_lo, x_hi) else step
