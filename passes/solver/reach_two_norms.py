"""Two post norms, linear weights only: the sandwich-norm block's reachable outputs (MATH.md 10).

A Gemma 2/3 or OLMo 2 block gives ``y = x + s_a * w_a + s_f * w_f`` where ``w_a = o / r(o)``
is the normalised attention output (``o = W_o a``) and ``w_f = u / r(u)`` the normalised MLP
output (``u = W_down h``), ``r(u) = sqrt(mean(u^2) + eps)``. With the scales fixed (a LoRA
adapter holds linear weights only) a rank-k move of ``W_o`` and of ``W_down`` sets each query
position's ``o`` and ``u`` to any vector, so ``w_a`` and ``w_f`` range over the spheres
``||w_a||^2 = d rho_a``, ``||w_f||^2 = d rho_f`` (``rho = M / (M + eps)`` at the magnitude
``M = mean(u^2)`` kept). The block output ``y_C`` is reachable iff ``t = y_C - x`` is a sum
``s_a * w_a + s_f * w_f`` of one point of each scaled sphere.

:func:`reach_two_norms` takes the full run's own split as the start (``p = (v_C - x) / s_a``:
when ``x = x_C`` it meets both constraints), holds one branch on its sphere and finds, on the
great circle from the start along the steepest change of the other branch's squared norm, the
first point where that norm is right (a bracketed 1-D root: no step can overshoot); where the
circle holds none it minimises the miss by alternating nearest points, and says how far the
target is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ctxc.passes.solver.rms_inversion import nearest_unit_rms

__all__ = ["TwoNormReach", "nearest_on_sphere", "reach_two_norms", "two_norm_targets"]

_BISECTIONS = 80
_ALTERNATIONS = 500
_TOL = 1e-13  # relative residual of a sphere constraint, float64


@dataclass(frozen=True)
class TwoNormReach:
    """One query position's normalised outputs and how well they meet the target.

    Attributes:
        w_a: normalised attention output [d], float64, ``||w_a||^2 = d rho_a``.
        w_f: normalised MLP output [d], float64, ``||w_f||^2 = d rho_f``.
        exact: the constraints and ``s_a w_a + s_f w_f = t`` hold to float64 rounding.
        miss: ``||s_a w_a + s_f w_f - t||`` (0 up to rounding when exact).
        steps: Gauss-Newton steps (exact) or alternations (not).
    """

    w_a: torch.Tensor
    w_f: torch.Tensor
    exact: bool
    miss: float
    steps: int


def nearest_on_sphere(s: torch.Tensor, t: torch.Tensor, rho: float) -> torch.Tensor:
    """``w`` with ``mean(w^2) = rho`` minimising ``||s * w - t||`` (``s`` may hold zeros).

    Coordinates where ``s_i = 0`` do not show in ``s * w``: they take what the visible ones
    leave of the budget ``d rho``, so when ``sum_J (t/s)^2 <= d rho`` over the visible set ``J``
    the target is met exactly; else ``w_J = c w'`` with ``c = sqrt(d rho / |J|)`` and ``w'`` the
    nearest unit-RMS vector for the scale ``c s_J`` (MATH.md 4).

    Args:
        s: scale [d]; t: target [d]; rho: wanted mean square, > 0.

    Returns:
        ``w`` [d], float64.

    Raises:
        ValueError: the scale is zero everywhere.
    """
    s, t = s.double().flatten(), t.double().flatten()
    live = s != 0
    d, n = s.numel(), int(live.sum())
    if n == 0:
        raise ValueError("the post-norm scale is 0 at every coordinate: nothing reaches y")
    w = torch.zeros(d, dtype=torch.float64)  # [d]
    exact = t[live] / s[live]  # [n]
    budget = float(exact.pow(2).sum())
    if n < d and budget <= d * rho:
        w[live] = exact
        w[~live] = math.sqrt((d * rho - budget) / (d - n))
        return w
    c = math.sqrt(d * rho / n)
    w[live] = c * nearest_unit_rms(c * s[live], t[live]).w
    return w


def reach_two_norms(
    s_a: torch.Tensor,
    s_f: torch.Tensor,
    t: torch.Tensor,
    rho_a: float,
    rho_f: float,
    start: torch.Tensor,
    like: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> TwoNormReach:
    """Normalised outputs ``w_a``, ``w_f`` on their spheres with ``s_a w_a + s_f w_f = t``.

    Coordinates split by which scale sees them: where both do, ``w_f = (t - s_a w_a) / s_f``
    and ``w_a`` is the unknown; where one alone does, that branch's coordinate is fixed to the
    target and the other's is slack, which turns that branch's sphere constraint into ``<=``
    (the slack coordinates take the rest of its budget).

    Args:
        s_a, s_f: the two post norms' effective scales [d].
        t: wanted sum of the two branches [d].
        rho_a, rho_f: each branch's mean square (``M / (M + eps)`` at the magnitude kept).
        start: the starting ``w_a`` [d] (the full run's split).
        like: the normalised outputs reached ``(f_a, f_f)`` [d] each: a branch's slack
            coordinates take the rest of its budget along these (an invisible coordinate of a
            large output, Gemma 3 270M's layer 1, keeps its sign: no down-projection move
            flips it); None: spread evenly.

    Returns:
        the :class:`TwoNormReach`.
    """
    s_a, s_f, t = s_a.double(), s_f.double(), t.double()
    d = t.numel()
    both, only_a, only_f = (s_a != 0) & (s_f != 0), (s_a != 0) & (s_f == 0), (s_a == 0) & (s_f != 0)
    blind = (s_a == 0) & (s_f == 0)
    fixed_a = t[only_a] / s_a[only_a]  # attention alone reaches these coordinates
    fixed_f = t[only_f] / s_f[only_f]
    cap_a = d * rho_a - float(fixed_a.pow(2).sum())  # what the shared coordinates may take
    cap_f = d * rho_f - float(fixed_f.pow(2).sum())
    slack_a, slack_f = bool((only_f | blind).any()), bool((only_a | blind).any())
    sa, sf, tb = s_a[both], s_f[both], t[both]
    w = _shared_point(sa, sf, tb, (cap_a, cap_f), (slack_a, slack_f), start.double()[both])
    if w is not None and not bool((t[blind] != 0).any()):
        w_a, w_f = torch.zeros(d, dtype=torch.float64), torch.zeros(d, dtype=torch.float64)
        w_a[both], w_a[only_a] = w, fixed_a
        w_f[both], w_f[only_f] = (tb - sa * w) / sf, fixed_f
        _fill_slack(w_a, only_f | blind, d * rho_a, None if like is None else like[0])
        _fill_slack(w_f, only_a | blind, d * rho_f, None if like is None else like[1])
        miss = float((s_a * w_a + s_f * w_f - t).norm())
        return TwoNormReach(w_a, w_f, True, miss, 0)
    return _alternate(s_a, s_f, t, rho_a, rho_f, start.double())


def _shared_point(
    sa: torch.Tensor,
    sf: torch.Tensor,
    t: torch.Tensor,
    caps: tuple[float, float],
    slack: tuple[bool, bool],
    start: torch.Tensor,
) -> torch.Tensor | None:
    """``w_a`` on the shared coordinates with ``||w_a||^2 = cap_a`` and
    ``||(t - sa w_a) / sf||^2 = cap_f`` (each ``<=`` when its branch has slack), near ``start``.

    One branch is held on its sphere and the other's constraint is solved along a great circle
    of it (:func:`_circle_root`): the branch with slack is the one that may fall inside its
    sphere, so the other is held (the attention when neither or both have slack).

    Returns:
        the point, or None when the circle holds no root (the target is on or beyond the
        boundary of the reachable set).
    """
    cap_a, cap_f = caps
    if min(cap_a, cap_f) < 0:  # the coordinates one branch alone reaches overdraw its sphere
        return None
    if slack[0] and not slack[1]:  # hold the MLP branch on its sphere: w_f = (t - sa w_a) / sf
        w_f = _circle_root(_onto((t - sa * start) / sf, cap_f), sa / sf, t / sf, cap_a, True)
        return None if w_f is None else (t - sf * w_f) / sa
    return _circle_root(_onto(start, cap_a), sf / sa, t / sa, cap_f, slack[1])


def _onto(w: torch.Tensor, cap: float) -> torch.Tensor:
    """``w`` scaled onto the sphere ``||w||^2 = cap`` (any point of it for ``w = 0``)."""
    n = float(w.norm())
    if n == 0.0:
        w = torch.ones_like(w)
        n = float(w.norm())
    return w * (math.sqrt(cap) / n)


def _circle_root(
    w0: torch.Tensor, ratio: torch.Tensor, c: torch.Tensor, cap: float, at_most: bool
) -> torch.Tensor | None:
    """A point ``w`` of the sphere through ``w0`` with ``h(w) = ||(c - w) / ratio||^2 - cap``
    zero (``<= 0`` with ``at_most``), on the great circle from ``w0`` along ``h``'s steepest
    tangent descent: the first sign change, bisected to float64 resolution.

    ``(c - w) / ratio`` is the other branch's shared coordinates: with ``ratio = sf / sa``,
    ``c = t / sa`` it is ``(t - sa w) / sf``.
    """

    def h(w: torch.Tensor) -> float:
        return float(((c - w) / ratio).pow(2).sum()) - cap

    h0 = h(w0)
    if abs(h0) <= _TOL * max(cap, 1e-300) or (at_most and h0 < 0):
        return w0
    r2 = float(w0 @ w0)
    grad = -2.0 * (c - w0) / ratio.pow(2)  # [n]
    tangent = grad - (float(grad @ w0) / r2) * w0
    norm = float(tangent.norm())
    if norm == 0.0:
        return None
    e = -math.copysign(1.0, h0) * tangent * (math.sqrt(r2) / norm)  # [n], |e| = |w0|

    def on(theta: float) -> torch.Tensor:
        return math.cos(theta) * w0 + math.sin(theta) * e

    guess = abs(h0) / (norm * math.sqrt(r2))  # the first-order step to the root
    grid = sorted(
        {guess * 2.0**k for k in range(-4, 24)} | {math.pi * i / 64 for i in range(1, 65)}
    )
    lo = 0.0
    for hi in (th for th in grid if 0 < th <= math.pi):
        if math.copysign(1.0, h(on(hi))) != math.copysign(1.0, h0):
            for _ in range(_BISECTIONS):
                mid = 0.5 * (lo + hi)
                if mid in (lo, hi):
                    break
                same = math.copysign(1.0, h(on(mid))) == math.copysign(1.0, h0)
                lo, hi = (mid, hi) if same else (lo, mid)
            return on(hi if at_most else (lo if abs(h(on(lo))) < abs(h(on(hi))) else hi))
        lo = hi
    return None


def _fill_slack(
    w: torch.Tensor, slack: torch.Tensor, budget: float, like: torch.Tensor | None
) -> None:
    """Put what ``w``'s visible coordinates leave of ``budget`` on its slack ones, along
    ``like``'s slack coordinates where they are not all zero, else evenly (mutates ``w``)."""
    n = int(slack.sum())
    if n:
        rest = max(budget - float(w[~slack].pow(2).sum()), 0.0)
        along = like.double()[slack] if like is not None else None
        if along is not None and float(along.norm()) > 0:
            w[slack] = along * (math.sqrt(rest) / float(along.norm()))
        else:
            w[slack] = math.sqrt(rest / n)


def _alternate(
    s_a: torch.Tensor,
    s_f: torch.Tensor,
    t: torch.Tensor,
    rho_a: float,
    rho_f: float,
    start: torch.Tensor,
) -> TwoNormReach:
    """The nearest pair found by alternating nearest points from ``start``: each branch in
    turn takes the point of its sphere nearest to what the other leaves (the miss never
    grows). Exact when the miss reaches float64 rounding; else the target is out of reach
    (or the two sets meet at so small an angle that the alternation stalls), and the miss is
    the distance reported."""
    w_a = nearest_on_sphere(torch.ones_like(start), start, rho_a)  # [d]
    best: TwoNormReach | None = None
    for i in range(_ALTERNATIONS):
        w_f = nearest_on_sphere(s_f, t - s_a * w_a, rho_f)  # [d]
        w_a = nearest_on_sphere(s_a, t - s_f * w_f, rho_a)
        miss = float((s_a * w_a + s_f * w_f - t).norm())
        if best is not None and miss >= best.miss * (1 - 1e-12):
            break
        exact = miss <= _TOL * max(float(t.norm()), 1.0)
        best = TwoNormReach(w_a.clone(), w_f.clone(), exact, miss, i + 1)
        if exact:
            break
    assert best is not None
    return best


def two_norm_targets(
    scales: tuple[torch.Tensor, torch.Tensor],
    t: torch.Tensor,
    split: tuple[torch.Tensor, torch.Tensor],
    branches: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    eps: tuple[float | None, float | None],
    lams: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[TwoNormReach]]:
    """Per query position, the attention projection's and the down projection's outputs.

    Each branch's sphere is that of a magnitude ``M``: ``mean(w^2) = rho = M / (M + eps)``.
    Where the norm's eps is known and dominates (``1 - rho > 1e-2`` at the magnitude reached:
    a small output, where eps is most of the root), ``M`` is chosen so that ``rho`` is the
    full run's own (``mean`` of its split), and ``o* = sqrt(eps / (1 - rho)) w_a``. Elsewhere
    the magnitude reached is kept, with ``rho`` read off the norm's own output (eps need not be
    known): ``o* = sqrt(M / rho) w_a``. Either way ``o* / r(o*) = w_a`` (MATH.md 9, 10).

    Args:
        scales: ``(s_a, s_f)``, the post-attention and post-FFN norms' effective scales [d].
        t: ``y_C - x`` [k, d]: what the two scaled branches must add up to.
        split: the full run's normalised outputs as seen from ``x``: ``((v_C - x) / s_a,
            (y_C - v_C) / s_f)`` [k, d] each (0 where the scale is).
        branches: ``(o, f_a, u, f_f)`` [k, d] each: the two projections' outputs and their
            normalised forms, as the reduced run reached them.
        eps: each norm's epsilon, or None where the graph does not say.
        lams: each branch's factor on its reached magnitude [k] (:func:`~ctxc.passes.solver.
            output_magnitude.choose_magnitude`: the least-rounding one; the new ``rho`` is
            computed from eps, so a factor needs a known eps); None: the magnitudes reached.

    Returns:
        ``o*`` [k, d], ``u*`` [k, d] (float32) and each position's :class:`TwoNormReach`.

    Raises:
        ValueError: a branch output is zero at some position (its norm fixes nothing).
    """
    o, f_a, u, f_f = (b.double() for b in branches)
    lam_a, lam_f = lams if lams is not None else (None, None)
    sphere_a = _sphere(o, f_a, split[0].double(), eps[0], lam_a)
    sphere_f = _sphere(u, f_f, split[1].double(), eps[1], lam_f)
    rows = zip(t, split[0], sphere_a[0], sphere_f[0], f_a, f_f, strict=True)
    found = [
        reach_two_norms(scales[0], scales[1], t_j, float(ra), float(rf), p_j, (fa_j, ff_j))
        for t_j, p_j, ra, rf, fa_j, ff_j in rows
    ]
    o_star = sphere_a[1][:, None] * torch.stack([r.w_a for r in found])  # [k, d]
    u_star = sphere_f[1][:, None] * torch.stack([r.w_f for r in found])  # [k, d]
    return o_star.float(), u_star.float(), found


def _sphere(
    out: torch.Tensor,
    normed: torch.Tensor,
    natural: torch.Tensor,
    eps: float | None,
    lam: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's ``rho`` and the factor ``r`` with ``out* = r w`` (see above) [k] each."""
    m = out.pow(2).mean(dim=1)  # [k]: M reached
    rho = normed.pow(2).mean(dim=1)  # [k]: M / (M + eps), read off the norm
    if bool((rho == 0).any()):
        raise ValueError("a projection's output is 0 at a query position: its norm sets nothing")
    keep = (m / rho).sqrt()  # [k]
    if eps is None or eps <= 0:
        return rho, keep
    if lam is not None:  # a larger magnitude, the norm's own rho for it (MATH.md 12)
        grown = lam.double() > 1
        big = lam.double().pow(2) * m  # [k]
        rho = torch.where(grown, big / (big + eps), rho)
        keep = torch.where(grown, (big + eps).sqrt(), keep)
    want = natural.pow(2).mean(dim=1)  # [k]: the full run's rho
    # eps is most of the root only for outputs of RMS below ~10 sqrt(eps) (tiny random models);
    # elsewhere the full run's rho, read through rounded y_C and v_C, is less precise than
    # 1 - rho itself, and an output shrunk to match it amplifies rounding (measured: Gemma 3
    # 270M's layer 4, 1 - rho = 1.03e-4, an output 63x smaller, 0.73 in llama.cpp).
    free = (1 - rho > 1e-2) & (want > 0) & (want < 1)
    rho = torch.where(free, want, rho)
    return rho, torch.where(free, (eps / (1 - rho)).sqrt(), keep)
