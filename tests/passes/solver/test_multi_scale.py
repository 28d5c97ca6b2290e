"""One post-norm scale for k query positions (passes/solver/multi_scale.py), and tiny models with
it."""

from __future__ import annotations

import pytest
import torch

import ctxc
from ctxc.passes.solver.multi_scale import fit_shared_scale, shared_scale_targets
from ctxc.passes.solver.primitive_moves import SCALE_FLOOR, ConditionError, stable_post_norm_target
from testbed.tiny_models import VOCAB, shared

EPS = 1e-6


def _case(seed: int, k: int = 3, d: int = 64):
    g = torch.Generator().manual_seed(seed)
    s = 1.0 + 0.5 * torch.randn(d, generator=g)  # [d]
    t = 2.0 * torch.randn(k, d, generator=g)  # [k, d]
    u = 3.0 * torch.randn(k, d, generator=g)  # [k, d]
    return s, t, u


def _rho(u: torch.Tensor) -> torch.Tensor:
    m = u.double().pow(2).mean(dim=1)  # [k]
    return m / (m + EPS)


def _norm(u: torch.Tensor) -> torch.Tensor:
    u = u.double()
    return u / (u.pow(2).mean(dim=1, keepdim=True) + EPS).sqrt()  # [k, d]


def _objective(s: torch.Tensor, t: torch.Tensor, scale: torch.Tensor, objective: str) -> float:
    """The divergence each objective minimises, of the scale ``scale`` from ``s``."""
    s, t, scale = s.double(), t.double(), scale.double()
    a = s.abs().clamp_min(SCALE_FLOOR)  # [d]
    c = t.pow(2).sum(dim=0)  # [d]
    r = (a / scale.abs()).pow(2)  # [d]: q / q0
    if objective == "ratio":
        return float((c * (r - 1.0 - r.log())).sum())
    return float((c * (r.sqrt() - 1.0).pow(2)).sum())


def _gradient(s: torch.Tensor, t: torch.Tensor, q: torch.Tensor, objective: str):
    a = s.double().abs().clamp_min(SCALE_FLOOR)  # [d]
    c = t.double().pow(2).sum(dim=0)  # [d]
    if objective == "ratio":
        return c * (a.pow(2) - 1.0 / q)  # [d]
    return c * (a.pow(2) - a / q.sqrt())  # [d]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rms_conditions_hold_and_outputs_hit_targets(seed: int) -> None:
    s, t, u = _case(seed)
    r = shared_scale_targets(s, t, u, _rho(u))
    f = _norm(r.targets)  # [k, d]: what the post norm makes of u*
    rms_now = f.pow(2).mean(dim=1)  # [k]
    assert torch.allclose(rms_now, _rho(u), rtol=1e-6), (rms_now, _rho(u))
    miss = (r.scale.double() * f - t.double()).abs().max()
    assert miss <= 1e-5 * float(t.abs().max()), f"max |s' f - t| {float(miss):.3g}"
    assert torch.allclose(r.targets.double().pow(2).mean(1), u.double().pow(2).mean(1), rtol=1e-5)
    assert bool((torch.sign(r.scale) == torch.sign(s)).all()), "a scale changed sign"


@pytest.mark.parametrize("objective", ["ratio", "nearest"])
@pytest.mark.parametrize("seed", [0, 1])
def test_is_the_least_change_among_shared_scales(seed: int, objective: str) -> None:
    """KKT of the convex problem in q = 1/s'^2: the stationarity residual vanishes, and no
    other feasible scale (random moves in the null space of the RMS equations) does better."""
    s, t, u = _case(seed)
    r = shared_scale_targets(s, t, u, _rho(u), objective)
    best = _objective(s, t, r.scale, objective)
    tt = t.double().pow(2)  # [k, d]
    q = r.scale.double().pow(-2)  # [d]
    grad = _gradient(s, t, q, objective)  # [d]
    lam = torch.linalg.lstsq(tt.T, grad[:, None]).solution  # [k, 1]
    kkt = (tt.T @ lam)[:, 0] - grad  # [d]
    # s' is returned in float32: stationarity holds to its rounding (1.3e-7 measured).
    assert float(kkt.abs().max()) <= 1e-6 * float(grad.abs().max()), float(kkt.abs().max())
    null = torch.eye(tt.shape[1], dtype=torch.float64) - torch.linalg.pinv(tt) @ tt  # [d, d]
    g = torch.Generator().manual_seed(seed + 10)
    for _ in range(20):
        dq = null @ torch.randn(tt.shape[1], generator=g, dtype=torch.float64)  # [d]
        other = q + 1e-3 * dq / dq.abs().max() * q.min()
        assert float((tt @ (other - q)).abs().max()) < 1e-9  # same RMS conditions as q
        alt = torch.sign(s.double()) * other.rsqrt()
        assert _objective(s, t, alt, objective) >= best - 1e-9 * best


def test_ratio_keeps_gains_below_nearest_on_an_outlier() -> None:
    """One position wants a huge output at one coordinate (Gemma's massive activations):
    the log barrier of ``ratio`` keeps that coordinate's gain far below ``nearest``'s."""
    s, t, u = _case(8)
    t[0, 7] = 200.0
    near = shared_scale_targets(s, t, u, _rho(u), "nearest")
    ratio = shared_scale_targets(s, t, u, _rho(u), "ratio")
    assert ratio.max_gain < near.max_gain, (ratio.max_gain, near.max_gain)


def test_one_position_is_the_stable_rule() -> None:
    s, t, u = _case(3, k=1)
    r = shared_scale_targets(s, t, u, _rho(u), "nearest")
    stable = stable_post_norm_target(s, t[0], u[0])  # [d], MATH.md 4
    assert torch.allclose(r.targets[0], stable, rtol=1e-5, atol=1e-5 * float(stable.abs().max()))


def test_zero_scales_and_untouched_coordinates() -> None:
    s, t, u = _case(4)
    s[:5] = 0.0  # Gemma 3 270M has exact zeros of 1 + w (MATH.md 8)
    t[:, 60:] = 0.0  # no position needs these coordinates
    r = shared_scale_targets(s, t, u, _rho(u))
    assert bool(torch.isfinite(r.scale).all() and torch.isfinite(r.targets).all())
    assert bool((r.scale[:5] != 0).all()), r.scale[:5]
    assert torch.equal(r.scale[60:], s[60:]), "untouched coordinates changed scale"
    assert bool((r.targets[:, 60:] == 0).all())
    f = _norm(r.targets)
    assert float((r.scale.double() * f - t.double()).abs().max()) <= 1e-5 * float(t.abs().max())


def test_alike_positions_with_other_magnitudes_are_refused_with_a_certificate() -> None:
    """t_2 = 2 t_1 forces w_2 = 2 w_1 under one scale: RMS 1 at both is impossible."""
    s, t, u = _case(5, k=1)
    t2 = torch.cat([t, 2.0 * t])  # [2, d]
    u2 = torch.cat([u, u])  # [2, d]: both magnitudes large, rho ~ 1 at both
    with pytest.raises(ConditionError, match=r"no shared post-norm scale.*Farkas") as info:
        shared_scale_targets(s, t2, u2, _rho(u2))
    assert "< 0" in str(info.value)


def test_identical_positions_are_served() -> None:
    s, t, u = _case(6, k=1)
    r = shared_scale_targets(s, torch.cat([t, t]), torch.cat([u, u]), _rho(torch.cat([u, u])))
    assert r.rms_error <= 1e-12


def test_fit_is_least_squares_and_exact_for_one_position() -> None:
    s, t, u = _case(7)
    f = _norm(u).float()  # [k, d]
    fit = fit_shared_scale(s, f, t)
    new = s + fit.ds
    ls = (f * t).sum(0) / f.pow(2).sum(0)
    assert torch.allclose(new, ls, rtol=1e-5)
    one = fit_shared_scale(s, f[:1], t[:1])
    assert torch.allclose((s + one.ds) * f[0], t[0], rtol=1e-5, atol=1e-5)
    f[:, 3] = 0.0
    with pytest.raises(ConditionError, match="exactly 0 at every query position"):
        fit_shared_scale(s, f, t)


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (n,), generator=g).tolist()


@pytest.mark.tiny
@pytest.mark.parametrize("update", ["stable", "standard", "output"])
@pytest.mark.parametrize("family", ["gemma3", "olmo2"])
def test_three_token_query_through_post_norm_scales(family: str, update: str) -> None:
    model = shared(family)  # built and traced once a session for the three rules
    ids = _ids(2, 20)
    result = ctxc.compile(model, context_ids=ids[:-3], query_ids=ids[-3:], update=update)
    rep = result.report
    gain = max(b.max_gain for b in rep.blocks)
    msg = (
        f"{family}/{update}, 3-token query: emitted max {rep.emitted.max_abs_logit_diff:.3g}, "
        f"solver {rep.patched.max_abs_logit_diff:.3g}, unpatched control "
        f"{rep.control.max_abs_logit_diff:.3g}, largest gain {gain:.3g}"
    )
    assert rep.emitted.max_abs_logit_diff <= 1e-5, msg
    assert rep.emitted.top1_match, msg
    assert rep.control.max_abs_logit_diff > 1e-2, "control too close: the test cannot fail; " + msg
    assert {d.rank for d in result.patch.deltas.values() if d.u is not None} == {3}, msg


def test_post_norm_bias_with_several_positions_is_refused_up_front() -> None:
    from ctxc.passes.locate.block_map import MlpBlock, NormSite
    from ctxc.passes.locate.plan import multi_refusal

    block = MlpBlock(
        path="model.layers.0.mlp",
        residual_in="v",
        residual_add="y",
        branch="b",
        mlp_in="z",
        inner=(),
        activation="h",
        outer=None,
        output_control="bias",  # type: ignore[arg-type]
        norm=NormSite(module="n", input="u", centered=True, bias="n.bias"),
    )
    assert "not 3" in multi_refusal(block, 3)
