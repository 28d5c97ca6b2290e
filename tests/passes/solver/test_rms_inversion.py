"""The RMSNorm inversion of MATH.md 4: constraint, optimality, hard case.

Optimality is checked against the exact optimum, not against random vectors: ``w`` minimises
``||s w - t||^2`` subject to ``mean(w^2) = 1`` if and only if, for some ``mu``,
``(s^2 - mu) w = s t`` and ``s_i^2 - mu >= 0`` for every i (the global optimality conditions of
a trust-region subproblem with an equality constraint, Moré and Sorensen 1983). An answer 1%
off violates the stationarity equation by about 1% of ``||s t||``.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxc.passes.solver.rms_inversion import nearest_unit_rms

vectors = st.integers(min_value=0, max_value=2**31 - 1)


def _certificate(s: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> tuple[float, float]:
    """(relative stationarity residual, how far mu exceeds min s^2) for a candidate ``w``.

    ``mu`` is the least-squares multiplier of ``(s^2 - mu) w = s t``; both figures are 0 at
    the exact optimum.
    """
    s, t, w = s.double(), t.double(), w.double()
    mu = float((w * (s.pow(2) * w - s * t)).sum() / w.pow(2).sum())
    residual = (s.pow(2) - mu) * w - s * t  # [d]
    scale = max(float((s * t).norm()), float((s.pow(2) * w).norm()), 1e-300)
    return float(residual.norm()) / scale, mu - float(s.pow(2).min())


def _assert_optimal(s, t, w, tol: float) -> None:
    rel, excess = _certificate(s, t, w)
    assert rel <= tol, f"stationarity residual {rel:.3g} (relative), tolerance {tol:.3g}"
    assert excess <= tol * float(s.pow(2).max()), f"mu exceeds min s^2 by {excess:.3g}"


def test_certificate_rejects_a_near_miss() -> None:
    """The check above can fail: the optimum moved by 1% and renormalised is refused."""
    s, t, _ = _case(7)
    w = nearest_unit_rms(s, t).w
    off = w * (1 + 0.01 * torch.linspace(-1, 1, w.numel(), dtype=torch.float64))
    off = off / off.pow(2).mean().sqrt()
    assert _certificate(s, t, off)[0] > 1e-4


def _case(seed: int, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(d, generator=g, dtype=torch.float64)
    s = torch.where(s.abs() < 0.05, torch.full_like(s, 0.05), s)
    t = torch.randn(d, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g) * 10)
    return s, t, g


@settings(max_examples=60, deadline=None)
@given(vectors)
def test_constraint_and_optimality(seed: int) -> None:
    s, t, _ = _case(seed)
    res = nearest_unit_rms(s, t)
    assert abs(float(res.w.pow(2).mean()) - 1.0) < 1e-9
    _assert_optimal(s, t, res.w, 1e-8)


def test_hard_case_when_target_vanishes_on_the_smallest_scale() -> None:
    s = torch.tensor([0.1, 1.0, 2.0, 3.0], dtype=torch.float64)
    t = torch.tensor([0.0, 0.01, 0.02, 0.0], dtype=torch.float64)
    res = nearest_unit_rms(s, t)
    assert res.hard_case
    assert abs(float(res.w.pow(2).mean()) - 1.0) < 1e-12
    assert abs(float(res.w[0])) > 1.0  # the remaining norm went onto the smallest scale


@settings(max_examples=60, deadline=None)
@given(vectors, st.floats(min_value=1e-12, max_value=1e-3))
def test_near_hard_case_stays_on_the_constraint_and_optimal(seed: int, tiny: float) -> None:
    s, t, _ = _case(seed, d=12)
    i = int(s.abs().argmin())
    t[i] = tiny * float(torch.sign(s[i]))  # s_i t_i -> 0 on the smallest scale: F nearly flat
    res = nearest_unit_rms(s, t)
    assert torch.isfinite(res.w).all()
    assert abs(float(res.w.pow(2).mean()) - 1.0) < 1e-9
    _assert_optimal(s, t, res.w, 1e-6)


def test_zero_target_gives_a_unit_rms_vector() -> None:
    s = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    res = nearest_unit_rms(s, torch.zeros(3, dtype=torch.float64))
    assert abs(float(res.w.pow(2).mean()) - 1.0) < 1e-12


def test_exact_zero_scale_is_refused_not_nan() -> None:
    import pytest

    with pytest.raises(ValueError, match="exact zero"):
        nearest_unit_rms(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]))
