"""The magnitude of least rounding behind a post norm (passes/solver/output_magnitude.py, MATH.md
12)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctxc.passes.solver import block_moves as moves
from ctxc.passes.solver.multi_scale import shared_scale_targets
from ctxc.passes.solver.output_magnitude import (
    MAGNITUDE_CAP,
    choose_magnitude,
    rounding_gain,
    summed_terms,
)

EPS = 1e-6


def test_summed_terms_are_the_absolute_terms_plus_the_output():
    g = torch.Generator().manual_seed(0)
    w, h = torch.randn(300, 40, generator=g), torch.randn(2, 40, generator=g)  # [out, in], [k, in]
    u = h @ w.T  # [k, out]
    want = (h[:, None, :] * w[None]).abs().sum(-1) + u.abs()  # [k, out]
    got = summed_terms(w, h, u)
    assert torch.allclose(got, want, rtol=1e-5), float((got - want).abs().max())


def test_choose_magnitude_is_the_excess_over_the_output_clamped():
    gain = torch.tensor([[2.0, 1.0], [0.5, 0.5], [1.0, 1.0]])  # [k, d]
    summed = torch.tensor([[10.0, 1.0], [1.0, 1.0], [1e6, 1.0]])
    t = torch.tensor([[4.0, 1.0], [2.0, 1.0], [1.0, 0.0]])
    lam = choose_magnitude(gain, summed, t, torch.ones(3), torch.float32)
    assert lam.tolist() == [5.0, 1.0, MAGNITUDE_CAP], lam  # 20 / 4; below 1; capped
    zero = choose_magnitude(gain[:1], summed[:1], torch.zeros(1, 2), torch.ones(1), torch.float32)
    assert zero.tolist() == [1.0], zero  # nothing to produce: the reached magnitude
    # float16: |u*| stays under sqrt(65504) ~ 256 (a norm squaring in float16 must not overflow)
    half = choose_magnitude(gain[:1], summed[:1], t[:1], torch.tensor([100.0]), torch.float16)
    assert half.tolist() == [pytest.approx(65504.0**0.5 / 100.0)], half


def test_shared_scale_targets_at_a_magnitude_are_exact():
    g = torch.Generator().manual_seed(1)
    s = 1.0 + 0.5 * torch.randn(64, generator=g)
    t, u = 2.0 * torch.randn(3, 64, generator=g), 0.01 * torch.randn(3, 64, generator=g)
    m = u.double().pow(2).mean(dim=1)
    lam = torch.tensor([1.0, 7.0, 300.0], dtype=torch.float64)
    got = shared_scale_targets(s, t, u, m / (m + EPS), magnitude=lam)
    stars = got.targets.double()  # [k, d]
    assert torch.allclose(stars.pow(2).mean(dim=1), lam**2 * m, rtol=1e-5)
    f = stars / (stars.pow(2).mean(dim=1, keepdim=True) + EPS).sqrt()  # the norm, its eps
    miss = (got.scale.double() * f - t.double()).abs().max()
    assert float(miss) <= 1e-5 * float(t.abs().max()), float(miss)


def _block(seed: int, d: int = 64, n: int = 512):
    """A post-norm block with gains from 0.01 to 100 and a down projection that cancels."""
    g = torch.Generator().manual_seed(seed)
    s = torch.exp(2.0 * torch.randn(d, generator=g))  # [d]
    w, a = torch.randn(d, n, generator=g), torch.randn(1, n, generator=g)
    return s, w, a, 3.0 * torch.randn(1, d, generator=g)


def _solve(seed: int, choose: bool):
    """The stable rule's move on :func:`_block`; the patched weight and scale, and the move."""
    s, w, a, t = _block(seed)
    u_now = a @ w.T  # [1, d]
    held = {}

    def reach(residual):
        u, v = moves.outer_move(residual, a)
        held["w"] = w + u @ v.T
        return F.rms_norm(a @ held["w"].T, (w.shape[0],), eps=EPS)

    summed = summed_terms(w, a, u_now) if choose else None
    f_now = F.rms_norm(u_now, (w.shape[0],), eps=EPS)
    move = moves.shared_scale_move(s, t, t, u_now, f_now, reach, summed)
    return held["w"], s + move.ds, a, t, move


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_chosen_magnitude_survives_other_arithmetic(seed):
    """Both patches are exact in float32; in exact arithmetic (float64) the kept magnitude is
    off by ~50 units of the output's rounding, the chosen one by about one."""
    errors = {}
    for choose in (False, True):
        w, scale, a, t, move = _solve(seed, choose)
        y32 = scale * F.rms_norm(a @ w.T, (w.shape[0],), eps=EPS)
        y64 = scale.double() * F.rms_norm(a.double() @ w.double().T, (w.shape[0],), eps=EPS)
        assert float((y32 - t).abs().max()) <= 1e-6 * float(t.abs().max())  # exact as solved
        errors[choose] = float((y64 - t.double()).abs().max())
        if choose:
            assert move.magnitude > 1.0 and move.rounding_gain <= 1.0 + 1e-6, move
    top = float(t.abs().max())
    msg = f"float64 vs float32: kept magnitude {errors[False]:.3g}, chosen {errors[True]:.3g}"
    assert errors[True] <= 4e-7 * top, msg
    assert errors[False] >= 10 * errors[True], msg


def test_rounding_gain_predicts_the_kept_magnitudes_excess():
    s, w, a, t = _block(2)
    u_now = a @ w.T
    gain = s.abs()[None] / u_now.pow(2).mean().sqrt()  # |s| / r(u), the kept magnitude
    kept = rounding_gain(gain, summed_terms(w, a, u_now), t, None)
    assert kept > 10.0, kept  # the same block as above: its float64 error is ~50x the chosen
    assert rounding_gain(gain, summed_terms(w, a, u_now), t, [kept]) == pytest.approx(1.0)
