"""Two post norms, linear weights only (MATH.md 10): the sandwich-norm block's reachable set."""

from __future__ import annotations

import math

import pytest
import torch

from ctxc.passes.solver.reach_post_norm import reachable_outputs
from ctxc.passes.solver.reach_two_norms import (
    nearest_on_sphere,
    reach_two_norms,
    two_norm_targets,
)

D = 96


def _on_sphere(g: torch.Generator, rho: float) -> torch.Tensor:
    w = torch.randn(D, generator=g, dtype=torch.float64)
    return w * math.sqrt(D * rho) / w.norm()  # [D], mean(w^2) = rho


def _case(seed: int, zeros_a: int = 0, zeros_f: int = 0, rho=(0.99, 0.97)):
    """Scales, a target made of one point of each sphere, seen from a perturbed ``x``."""
    g = torch.Generator().manual_seed(seed)
    s_a = 1 + 0.6 * torch.randn(D, generator=g, dtype=torch.float64)
    s_f = 1 + 0.6 * torch.randn(D, generator=g, dtype=torch.float64)
    s_a[:zeros_a] = 0
    s_f[D - zeros_f :] = 0
    w_a, w_f = _on_sphere(g, rho[0]), _on_sphere(g, rho[1])
    dx = 0.03 * torch.randn(D, generator=g, dtype=torch.float64)  # x - x_C
    t = s_a * w_a + s_f * w_f - dx  # y_C - x
    start = torch.where(s_a != 0, (s_a * w_a - dx) / torch.where(s_a != 0, s_a, 1), 0)
    return s_a, s_f, t, start


def _check_exact(s_a, s_f, t, r, rho_a=0.99, rho_f=0.97) -> None:
    got = s_a * r.w_a + s_f * r.w_f
    err = (got - t).abs()
    msg = f"max {float(err.max()):.3g} mean {float(err.mean()):.3g}"
    assert r.exact and float(err.max()) <= 1e-12, msg
    assert abs(float(r.w_a.pow(2).mean()) - rho_a) <= 1e-12, float(r.w_a.pow(2).mean())
    assert abs(float(r.w_f.pow(2).mean()) - rho_f) <= 1e-12, float(r.w_f.pow(2).mean())


@pytest.mark.parametrize("seed", range(4))
def test_a_target_off_the_full_runs_split_is_met_exactly(seed: int) -> None:
    s_a, s_f, t, start = _case(seed)
    r = reach_two_norms(s_a, s_f, t, 0.99, 0.97, start)
    _check_exact(s_a, s_f, t, r)
    # the start itself misses (x moved): the solver moved it, and not far
    miss0 = float((s_a * start + s_f * ((t - s_a * start) / s_f)).sub(t).norm())
    assert miss0 <= 1e-12 or r.steps > 0
    assert float((r.w_a - start).norm()) < 0.5 * float(start.norm())
    again = reach_two_norms(s_a, s_f, t, 0.99, 0.97, start)
    assert torch.equal(again.w_a, r.w_a) and torch.equal(again.w_f, r.w_f), "not deterministic"


@pytest.mark.parametrize(("zeros_a", "zeros_f"), [(0, 5), (3, 0), (2, 4)])
def test_coordinates_one_scale_cannot_see_are_met_by_the_other(zeros_a, zeros_f) -> None:
    """Gemma 3 270M's post-FFN scales are exactly 0 at 9 coordinates (MATH.md 8)."""
    s_a, s_f, t, start = _case(7, zeros_a, zeros_f)
    r = reach_two_norms(s_a, s_f, t, 0.99, 0.97, start)
    _check_exact(s_a, s_f, t, r)


def test_an_unreachable_target_reports_its_distance() -> None:
    s_a, s_f, t, start = _case(3)
    far = 6.0 * t
    r = reach_two_norms(s_a, s_f, far, 0.99, 0.97, start)
    # no pair of the two spheres is longer than the sum of their largest scaled radii
    reach = float(s_a.abs().max()) * math.sqrt(D * 0.99) + float(s_f.abs().max()) * math.sqrt(
        D * 0.97
    )
    assert not r.exact and r.miss >= float(far.norm()) - reach > 0, (r.miss, float(far.norm()))
    got = float((s_a * r.w_a + s_f * r.w_f - far).norm())
    assert abs(got - r.miss) <= 1e-9 * got, (got, r.miss)
    assert abs(float(r.w_a.pow(2).mean()) - 0.99) <= 1e-9


def test_nearest_on_sphere_is_the_single_norm_rule_at_unit_rms() -> None:
    g = torch.Generator().manual_seed(5)
    s = 1 + torch.randn(D, generator=g)
    s[:4] = 0
    t = 3 * torch.randn(D, generator=g)
    u = torch.randn(1, D, generator=g)
    want = reachable_outputs(s, t[None], u)[0].double() / u.double().pow(2).mean().sqrt()
    got = nearest_on_sphere(s, t, 1.0)
    assert float((got - want).abs().max()) <= 1e-6, float((got - want).abs().max())


@pytest.mark.parametrize("eps", [1e-6, 1.0])
def test_outputs_normalise_back_to_the_solved_points(eps: float) -> None:
    """``o* / sqrt(mean(o*^2) + eps) = w_a``: at the kept magnitude (eps small against the
    outputs) and at a chosen one (eps most of the root: the full run's rho is taken)."""
    s_a, s_f, t, start = _case(11, rho=(0.5, 0.6))
    g = torch.Generator().manual_seed(1)
    o, u = 0.1 * torch.randn(2, 1, D, generator=g, dtype=torch.float64)
    f_a = o / (o.pow(2).mean() + eps).sqrt()
    f_f = u / (u.pow(2).mean() + eps).sqrt()
    want_f = torch.where(s_f != 0, (t - s_a * start) / s_f, 0)
    split = (start[None], want_f[None])
    o_star, u_star, found = two_norm_targets(
        (s_a.float(), s_f.float()), t[None].float(), split, (o, f_a, u, f_f), (eps, eps)
    )
    for out, w in ((o_star, found[0].w_a), (u_star, found[0].w_f)):
        normed = out.double() / (out.double().pow(2).mean() + eps).sqrt()
        err = (normed[0] - w).abs()
        assert float(err.max()) <= 1e-6 * float(w.abs().max()), float(err.max())
    assert all(r.exact for r in found)
