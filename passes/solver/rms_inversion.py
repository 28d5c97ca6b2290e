"""The nearest unit-RMS vector to a target after an element-wise scale (MATH.md 4, Appendix B).

Solves ``min_w ||s * w - t||^2`` subject to ``mean(w^2) = 1``. Lagrange gives
``w_i = s_i t_i / (s_i^2 - mu)`` with ``mu < min_i s_i^2`` the unique root of
``F(mu) = mean(s_i^2 t_i^2 / (s_i^2 - mu)^2) - 1``, which increases on that interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["RmsInversion", "nearest_unit_rms"]

_MAX_ITER = 200


@dataclass(frozen=True)
class RmsInversion:
    """Result of :func:`nearest_unit_rms`.

    Attributes:
        w: the unit-RMS vector [d], float64.
        mu: the Lagrange multiplier.
        hard_case: True when ``F`` stays below 1 up to ``min s^2`` (the remaining norm went onto
            the minimising coordinates).
        iterations: bisection steps taken.
    """

    w: torch.Tensor
    mu: float
    hard_case: bool
    iterations: int


def nearest_unit_rms(s: torch.Tensor, t: torch.Tensor) -> RmsInversion:
    """Closest vector to ``t`` of the form ``s * w`` with ``mean(w^2) = 1``.

    Args:
        s: scale [d], no zero entries (floor them first: MATH.md 8).
        t: target [d].

    Returns:
        the :class:`RmsInversion`, computed in float64.

    Raises:
        ValueError: when ``s`` has a zero or non-finite entry, or ``t`` is not finite.
    """
    s = s.detach().to(torch.float64).flatten()
    t = t.detach().to(torch.float64).flatten()
    if not (torch.isfinite(s).all() and torch.isfinite(t).all()):
        raise ValueError("scale or target is not finite")
    if (s == 0).any():
        raise ValueError("scale has an exact zero: floor |s| before inverting")
    d = s.numel()
    s2 = s * s  # [d]
    st2 = (s * t) ** 2  # [d]
    m = float(s2.min())

    def excess(mu: float) -> float:
        return float((st2 / (s2 - mu) ** 2).mean()) - 1.0

    if float(st2.sum()) == 0.0:
        # t = 0: every unit-RMS w is equally far; take the one along the smallest scales.
        return _hard_case(s2, s * t, m, d)
    # Bracket from MATH.md 4: F(lo) <= 0 by construction.
    lo = m - math.sqrt(float(st2.sum())) / math.sqrt(d)
    hi = m
    # F diverges at mu -> m unless s_i t_i = 0 on every minimising coordinate (the hard case).
    near = (s2 - m) <= 1e-12 * max(m, 1e-300)
    if float(st2[near].sum()) == 0.0:
        probe = m - 1e-15 * max(abs(m), 1.0)
        if excess(probe) <= 0.0:
            return _hard_case(s2, s * t, m, d)
    # Safeguarded Newton on phi(mu) = F(mu)^(-1/2), nearly linear in mu (the secular-equation
    # trick of trust-region solvers); a step leaving the bracket [lo, hi] bisects instead.
    iterations, mu = 0, lo
    while iterations < _MAX_ITER:
        iterations += 1
        q = s2 - mu  # [d], > 0 on the bracket
        f = float((st2 / q**2).mean())
        if math.isnan(f):
            raise ValueError("NaN while solving the RMS inversion")
        if f > 1.0:
            hi = mu
        else:
            lo = mu
        if abs(f - 1.0) <= 1e-15:
            break
        df = float((2.0 * st2 / q**3).mean())  # F'(mu) > 0
        step = (f**-0.5 - 1.0) / (-0.5 * f**-1.5 * df) if df > 0 and f > 0 else math.inf
        new = mu - step
        if not lo < new < hi:
            new = 0.5 * (lo + hi)
        if new == mu or hi - lo <= 1e-15 * max(abs(lo), abs(hi), 1e-300):
            break
        mu = new
    if abs(f - 1.0) > 1e-12:
        # F is so steep near min s^2 (a near-hard case, s_i t_i ~ 0 on the smallest scale) that
        # no float64 mu reaches F = 1. Take mu = lo (F(lo) <= 1) and, as in the hard case, put
        # the missing norm on the smallest scale's coordinate: rescaling every coordinate would
        # break stationarity (s^2 - mu) w = s t everywhere else.
        w = (s * t) / (s2 - lo)  # [d]
        i = int(torch.argmin(s2))
        rest = d - float(w.pow(2).sum() - w[i] ** 2)
        w[i] = math.copysign(math.sqrt(max(rest, 0.0)), float(s[i] * t[i]) or 1.0)
        return RmsInversion(w=w, mu=lo, hard_case=False, iterations=iterations)
    w = (s * t) / (s2 - mu)  # [d]
    w = w / w.pow(2).mean().sqrt()  # remove the last Newton residue from the constraint
    return RmsInversion(w=w, mu=mu, hard_case=False, iterations=iterations)


def _hard_case(s2: torch.Tensor, st: torch.Tensor, m: float, d: int) -> RmsInversion:
    """``mu = min s^2``: far coordinates by the formula, the rest of the norm on a minimiser."""
    near = (s2 - m) <= 1e-12 * max(m, 1e-300)
    far = ~near
    w = torch.zeros_like(s2)  # [d]
    w[far] = st[far] / (s2[far] - m)
    remaining = d - float(w.pow(2).sum())
    w[int(torch.nonzero(near)[0])] = math.sqrt(max(remaining, 0.0))
    return RmsInversion(w=w, mu=m, hard_case=True, iterations=0)
