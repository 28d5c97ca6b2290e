"""The RMSNorm inversion of MATH.md 4: constraint, optimality, hard case."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ctxc.passes.rms_inversion import nearest_unit_rms

vectors = st.integers(min_value=0, max_value=2**31 - 1)


def _case(seed: int, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(d, generator=g, dtype=torch.float64)
    s = torch.where(s.abs() < 0.05, torch.full_like(s, 0.05), s)
    t = torch.randn(d, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g) * 10)
    return s, t, g


@settings(max_examples=60, deadline=None)
@given(vectors)
def test_constraint_and_optimality(seed: int) -> None:
    s, t, g = _case(seed)
    res = nearest_unit_rms(s, t)
    assert abs(float(res.w.pow(2).mean()) - 1.0) < 1e-9
    best = float((s * res.w - t).pow(2).sum())
    for _ in range(200):  # no random unit-RMS vector does better
        w = torch.randn(s.numel(), generator=g, dtype=torch.float64)
        w = w / w.pow(2).mean().sqrt()
        assert float((s * w - t).pow(2).sum()) >= best - 1e-9 * max(1.0, best)


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
    s, t, g = _case(seed, d=12)
    i = int(s.abs().argmin())
    t[i] = tiny * float(torch.sign(s[i]))  # s_i t_i -> 0 on the smallest scale: F nearly flat
    res = nearest_unit_rms(s, t)
    assert torch.isfinite(res.w).all()
    assert abs(float(res.w.pow(2).mean()) - 1.0) < 1e-9
    best = float((s * res.w - t).pow(2).sum())
    for _ in range(100):
        w = torch.randn(s.numel(), generator=g, dtype=torch.float64)
        w = w / w.pow(2).mean().sqrt()
        assert float((s * w - t).pow(2).sum()) >= best - 1e-7 * max(1.0, best)


def test_zero_target_gives_a_unit_rms_vector() -> None:
    s = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    res = nearest_unit_rms(s, torch.zeros(3, dtype=torch.float64))
    assert abs(float(res.w.pow(2).mean()) - 1.0) < 1e-12


def test_exact_zero_scale_is_refused_not_nan() -> None:
    import pytest

    with pytest.raises(ValueError, match="exact zero"):
        nearest_unit_rms(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]))
