"""The shared-scale dual's start (passes/solver/scale_start.py): the batched halvings give, bit for
bit,
the one-halving-at-a-time bisection they replace (issue 11)."""

from __future__ import annotations

import math

import pytest
import torch

from ctxc.passes.solver import scale_start
from ctxc.passes.solver.scale_start import HALVINGS, bisect_start


def _one_at_a_time(tt, b, a2, q_of) -> torch.Tensor:
    """The bisection as multi_scale computed it before (one halving per tensor evaluation)."""
    big = tt > 0
    inf = torch.full_like(tt, math.inf)
    top = torch.where(big, a2.expand_as(tt), inf).amin(dim=1)
    hi = top.clone()
    lo = top - 1.0
    for _ in range(200):
        under = (tt * q_of(a2 - lo[:, None])).sum(dim=1) <= b
        if bool(under.all()):
            break
        lo = torch.where(under, lo, top - 4.0 * (top - lo))
    for _ in range(HALVINGS):
        mid = 0.5 * (lo + hi)
        over = (tt * q_of(a2 - mid[:, None])).sum(dim=1) > b
        hi, lo = torch.where(over, mid, hi), torch.where(over, lo, mid)
    return lo


def _case(seed: int, k: int, n: int):
    """Squared targets (some columns zero), floored squared scales (some equal), rhs."""
    g = torch.Generator().manual_seed(seed)
    size = 10.0 ** (4 * torch.rand(1, generator=g).item() - 2)
    tt = (size * torch.randn(k, n, generator=g, dtype=torch.float64)).pow(2)
    tt[:, : n // 5] = 0.0  # coordinates no position needs
    a2 = (3 * torch.rand(n, generator=g, dtype=torch.float64)).clamp_min(0.5).pow(2)
    b = n * torch.rand(k, generator=g, dtype=torch.float64) * (1 + 99 * (seed % 2))
    return tt, b, a2


def _q_of(objective: str, a2: torch.Tensor):
    if objective == "ratio":
        return lambda gap: gap.reciprocal()
    return lambda gap: a2 / gap.pow(2)


@pytest.mark.parametrize("objective", ["ratio", "nearest"])
@pytest.mark.parametrize(("k", "n"), [(1, 640), (1, 64), (3, 100), (5, 33)])
def test_batched_halvings_match_one_at_a_time(objective: str, k: int, n: int) -> None:
    mismatches = []
    for seed in range(12):
        tt, b, a2 = _case(seed, k, n)
        q_of = _q_of(objective, a2)
        want = _one_at_a_time(tt, b, a2, q_of)
        got = bisect_start(tt, b, a2, q_of)
        again = bisect_start(tt, b, a2, q_of)  # run twice: the same
        same = torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
        if not (same and torch.equal(again, got)):
            mismatches.append((seed, float((got - want).abs().max())))
    assert not mismatches, f"seed, max |batched - one at a time|: {mismatches}"


def test_stops_at_the_fixed_point_and_takes_the_levels_in_batches(monkeypatch) -> None:
    tt, b, a2 = _case(3, 1, 640)
    calls = []
    walk = scale_start._walk

    def counted(*args):
        calls.append(args[3])  # levels in this batch
        return walk(*args)

    monkeypatch.setattr(scale_start, "_walk", counted)
    got = bisect_start(tt, b, a2, _q_of("ratio", a2))
    want = _one_at_a_time(tt, b, a2, _q_of("ratio", a2))
    assert torch.equal(got, want), f"max diff {float((got - want).abs().max()):.3g}"
    # A double interval stops halving after about 53 levels (the mantissa): far fewer than 120.
    assert sum(calls) < HALVINGS, f"{sum(calls)} levels evaluated"
    assert len(calls) > 1 and max(calls) > 1, calls


def test_a_fixed_point_differs_in_the_sign_of_zero() -> None:
    assert not scale_start._same(0.0, -0.0)
    assert scale_start._same(1.5, 1.5)
    assert not scale_start._same(math.nan, math.nan)
