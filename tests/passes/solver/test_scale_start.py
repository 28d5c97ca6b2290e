"""The shared-scale dual's start (passes/solver/scale_start.py): Newton on the secular equation
gives each position's root, as the 120-halving bisection it replaced did (issue 33), in a
fraction of the evaluations."""

from __future__ import annotations

import math

import pytest
import torch

from ctxc.passes.solver.scale_start import own_multipliers

HALVINGS = 120


def _bisection(tt, b, a2, q_of) -> torch.Tensor:
    """The start as multi_scale computed it before: the left end after 120 halvings."""
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


def _fns(objective: str, a2: torch.Tensor, calls: list | None = None):
    def q_of(gap):
        if calls is not None:
            calls.append(1)
        return gap.reciprocal() if objective == "ratio" else a2 / gap.pow(2)

    def dq_of(gap):
        return gap.pow(2).reciprocal() if objective == "ratio" else 2.0 * a2 / gap.pow(3)

    return q_of, dq_of


@pytest.mark.parametrize("objective", ["ratio", "nearest"])
@pytest.mark.parametrize(("k", "n"), [(1, 640), (1, 64), (3, 100), (5, 33)])
def test_newton_finds_the_root_the_bisection_found(objective: str, k: int, n: int) -> None:
    worst_miss, worst_gap, evaluations, halvings = 0.0, 0.0, 0, 0
    bisection_miss = 0.0
    for seed in range(12):
        tt, b, a2 = _case(seed, k, n)
        calls: list = []
        q_of, dq_of = _fns(objective, a2, calls)
        got = own_multipliers(tt, b, a2, q_of, dq_of)
        evaluations = max(evaluations, len(calls))
        again = own_multipliers(tt, b, a2, *_fns(objective, a2))  # run twice: the same
        assert torch.equal(again, got), f"seed {seed}: a second run differs"
        counted: list = []
        want = _bisection(tt, b, a2, _fns(objective, a2, counted)[0])
        halvings = max(halvings, len(counted))
        top = torch.where(tt > 0, a2.expand_as(tt), math.inf).amin(dim=1)
        assert bool((got < top).all()), f"seed {seed}: a start at or past the pole"
        f, f_want = ((tt * q_of(a2 - x[:, None])).sum(dim=1) for x in (got, want))
        worst_miss = max(worst_miss, float(((f - b).abs() / b).max()))
        bisection_miss = max(bisection_miss, float(((f_want - b).abs() / b).max()))
        worst_gap = max(worst_gap, float(((got - want).abs() / (top - want)).max()))
    # The root as well as the double allows (near the pole F is steep: one ulp of lambda moves
    # it by more than one of b), no worse than the bisection's; the two within 1e-8 relative
    # to the distance to the pole (what the scale s'^2 = a^2 - lambda is made of; measured:
    # 2e-10 at most, where the bisection's own miss is 1.8e-10).
    msg = (
        f"max |F - b| / b {worst_miss:.3g} (bisection {bisection_miss:.3g}), max relative "
        f"distance {worst_gap:.3g}; {evaluations} evaluations against {halvings}"
    )
    assert worst_miss <= max(1e-13, bisection_miss), msg
    assert worst_gap <= 1e-8, msg
    assert evaluations < halvings / 2, msg


@pytest.mark.parametrize("objective", ["ratio", "nearest"])
@pytest.mark.parametrize("n", [33, 640, 8192])
def test_one_position_alone_is_its_row_of_a_batch(objective: str, n: int) -> None:
    """k = 1 evaluates F without building a [k, n] batch (``ctxc generate``'s every step): the
    root is the one a batch of copies of that row finds, bit for bit (below torch's parallel
    grain, 32768, each row of a batch is reduced alike)."""
    for seed in range(8):
        tt, b, a2 = _case(seed, 1, n)
        alone = own_multipliers(tt, b, a2, *_fns(objective, a2))  # [1]
        batch = own_multipliers(tt.repeat(3, 1), b.repeat(3), a2, *_fns(objective, a2))  # [3]
        diff = (batch - alone).abs()
        assert torch.equal(batch, alone.expand(3)), (
            f"seed {seed}: alone {alone.tolist()} against the batch's {batch.tolist()} "
            f"(max diff {float(diff.max()):.3g}, mean {float(diff.mean()):.3g})"
        )


@pytest.mark.parametrize("n", [640, 40000, 262144])
def test_a_row_sums_as_its_one_row_matrix(n: int) -> None:
    """What the k = 1 evaluation rests on: a [n] sum is a [1, n] matrix's row sum, bit for bit,
    at any width (the batched path summed [1, n] along its rows)."""
    g = torch.Generator().manual_seed(n)
    for _ in range(10):
        x = torch.randn(1, n, generator=g, dtype=torch.float64)
        x = x * torch.rand(1, n, generator=g, dtype=torch.float64).mul(20).exp()
        row, flat = float(x.sum(dim=1)[0]), float(x[0].sum())
        assert row == flat, f"[1, n] row sum {row!r} against the [n] sum {flat!r}"
