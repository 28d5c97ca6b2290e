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
