"""One post-norm scale for k query positions (MATH.md 7, 9): pure tensor functions.

A block with a scaled RMS post norm gives, at query position j,
``y_j = v_j + s ⊙ f_j`` with ``f_j = u_j / sqrt(mean(u_j^2) + eps)`` and ``u_j = W_down a_j``.
For one position the scale absorbs whatever the MLP output misses (MATH.md 2, 4). For k
positions one shared scale ``s'`` must serve them all: ``s' ⊙ w_j = t_j`` (``t_j = y_C,j - v_j``)
forces ``w_j = t_j / s'`` and the post norm forces ``mean(w_j^2) = rho_j = M_j / (M_j + eps)``
(``M_j = mean(u_j^2)``). With ``q_i = 1 / s'_i^2`` these are k linear equations
``sum_i t_ji^2 q_i = d rho_j`` in ``d >> k`` positive unknowns; the rank-k output move on the
down projection (MATH.md 7) then gives each position ``u*_j = sqrt(M_j + eps) w_j``.

Among the solutions we take the least change of the scale: ``objective="ratio"`` (the
default) minimises the weighted Burg divergence ``sum_i c_i (q_i/q0_i - 1 - log(q_i/q0_i))``
from ``q0 = 1/s^2`` (``c_i = sum_j t_ji^2``), convex in ``q``, with a log barrier against
large gains; KKT gives ``s'_i^2 = s_i^2 - mu_i`` with ``mu_i = sum_j pi_ji lambda_j`` and
``pi_ji = t_ji^2 / c_i``. ``objective="nearest"`` minimises the stable rule's distance
``sum_j ||s ⊙ w_j - t_j||^2`` over ``w_j = t_j / s'``, i.e. ``sum_i c_i (|s_i|/|s'_i| - 1)^2``,
also convex in ``q``; KKT gives ``|s'_i| = |s_i| - mu_i / |s_i|``, for k = 1 exactly the
stable rule (MATH.md 4). On Gemma 3 270M (9-token query) ``nearest`` reached gains of 1.2e4
where ``ratio`` stays at the model's own largest ``|s|`` (746 at that block): large gains
amplify rounding (MATH.md 4, 8). ``lambda`` [k] maximises the concave dual by damped Newton,
started from each position's own multiplier (a secular equation's root, by Newton:
passes/solver/scale_start.py). When no positive ``q`` exists, Farkas' lemma gives
``y`` with ``T^T y >= 0`` and ``b.y < 0`` (T the squared targets): the proof that the block
cannot be matched with these magnitudes, reported with its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ctxc.passes.solver.primitive_moves import SCALE_FLOOR, ConditionError, ScaleMove
from ctxc.passes.solver.scale_start import own_multipliers

__all__ = [
    "SharedScale",
    "SharedScaleFit",
    "fit_shared_scale",
    "shared_scale_targets",
]

_OBJECTIVES = ("ratio", "nearest")
_MAX_ITER = 500
_TOL = 1e-13  # relative residual of the k RMS equations
# k = 1: the root's residual taken as it is (near a pole one ulp of lambda moves F by 1e-10 of
# itself: no Newton step does better); the float32 outputs resolve 1e-7.
_ALONE = 1e-9


@dataclass(frozen=True)
class SharedScale:
    """Result of :func:`shared_scale_targets`.

    Attributes:
        scale: the shared scale ``s'`` [d], float32.
        targets: outer-linear outputs ``u*`` [k, d], float32, with ``s' ⊙ u*_j / rms(u*_j) = t_j``.
        rho: ``mean(w_j^2)`` each position's normalised output must have [k], float64.
        iterations: Newton steps taken.
        rms_error: largest relative miss ``|mean(w_j^2) / rho_j - 1|`` after the solve.
        max_change: largest ``|s'_i - s_i|``.
        max_gain: largest ``|s'_i|``.
    """

    scale: torch.Tensor
    targets: torch.Tensor
    rho: torch.Tensor
    iterations: int
    rms_error: float
    max_change: float
    max_gain: float


def shared_scale_targets(
    s: torch.Tensor,
    t: torch.Tensor,
    u: torch.Tensor,
    rho: torch.Tensor,
    objective: str = "ratio",
    magnitude: torch.Tensor | None = None,
) -> SharedScale:
    """The scale ``s'`` and MLP outputs ``u*`` matching k positions through one RMS post norm.

    Args:
        s: current effective scale [d] (``1 + w`` for Gemma); ``|s|`` is floored at
            :data:`SCALE_FLOOR` for the fit only (MATH.md 8), the sign kept (+ at exact zeros).
        t: wanted scaled outputs ``y_C - v`` [k, d].
        u: outer-linear outputs reached [k, d]; their magnitudes ``M_j = mean(u_j^2)`` are kept.
        rho: ``mean(f_j^2)`` of the post norm's output for ``u_j`` [k] (``M_j / (M_j + eps)``,
            read off the norm as the model computes it, so no epsilon has to be known).
        objective: ``ratio`` (default): the weighted Burg divergence
            ``sum_i c_i (q_i/q0_i - 1 - log(q_i/q0_i))``, ``s'_i^2 = s_i^2 - mu_i``, whose log
            barrier keeps gains near the model's own; ``nearest``: the stable rule's distance
            ``sum_j ||s ⊙ w_j - t_j||^2`` (k = 1: MATH.md 4), ``|s'_i| = |s_i| - mu_i/|s_i|``.

    Returns:
        the :class:`SharedScale`; coordinates where every ``t_ji = 0`` keep ``s_i`` and get
        ``u*_ji = 0``.

    Raises:
        ConditionError: non-finite input, or no positive shared scale exists (with the Farkas
            certificate's value), or the Newton solve did not converge (with the residual).
    """
    s, t, u = s.double().flatten(), t.double(), u.double()  # [d], [k, d], [k, d]
    rho = rho.double().flatten()  # [k]
    if not all(bool(torch.isfinite(x).all()) for x in (s, t, u, rho)):
        raise ConditionError("scale, target, MLP output or its RMS is not finite")
    d = t.shape[1]
    sign = torch.where(s < 0, -torch.ones_like(s), torch.ones_like(s))  # [d]
    a2 = s.abs().clamp_min(SCALE_FLOOR).pow(2)  # [d]: floored s^2 (MATH.md 8)
    m, rho = _magnitudes(u, rho, magnitude)  # [k], [k]: M_j kept (or lambda_j^2 M_j)
    t2 = t.pow(2)  # [k, d]
    live = t2.sum(dim=1) > 0  # [k]: positions with something to produce
    if bool((live & ((m == 0) | (rho <= 0))).any()):
        j = int(torch.nonzero(live & ((m == 0) | (rho <= 0)))[0])
        raise ConditionError(
            f"MLP output is exactly 0 at query position {j} while its wanted output is not "
            f"(max |t| {float(t[j].abs().max()):.3g}): no magnitude to keep"
        )
    support = t2.sum(dim=0) > 0  # [d]: coordinates some position needs
    tt = t2[live][:, support]  # [k', n]
    b = d * rho[live]  # [k']
    if objective not in _OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; expected one of {_OBJECTIVES}")
    if not bool(live.any()):  # nothing to produce anywhere: u* = 0 with the scale unchanged
        zero = torch.zeros_like(t, dtype=torch.float32)  # [k, d]
        return SharedScale(
            s.float(), zero, torch.zeros_like(rho), 0, 0.0, 0.0, float(s.abs().max())
        )
    lam, iterations = _solve_dual(tt, b, a2[support], sign.numel(), objective)
    mu = (tt / tt.sum(dim=0)).T @ lam  # [n]: mu_i = sum_j pi_ji lambda_j
    gap = a2[support] - mu  # [n], > 0
    new = s.clone()  # [d]
    mag = gap.sqrt() if objective == "ratio" else gap / a2[support].sqrt()  # [n]: |s'_i|
    new[support] = sign[support] * mag
    w = t / torch.where(support, new, torch.ones_like(new))  # [k, d]: w_j = t_j / s'
    w[:, ~support] = 0.0
    # rms(u*_j) = sqrt(M_j + eps) = sqrt(M_j / rho_j) keeps mean(u*_j^2) = M_j.
    targets = (m / torch.where(live, rho, torch.ones_like(rho))).sqrt()[:, None] * w  # [k, d]
    targets[~live] = 0.0
    got = w.pow(2).mean(dim=1)  # [k]
    err = (got[live] / rho[live] - 1.0).abs()
    if not bool(torch.isfinite(new).all() and torch.isfinite(targets).all()):
        raise ConditionError("shared post-norm scale is not finite")
    return SharedScale(
        scale=new.float(),
        targets=targets.float(),
        rho=rho,
        iterations=iterations,
        rms_error=float(err.max()) if err.numel() else 0.0,
        max_change=float((new - s).abs().max()),
        max_gain=float(new.abs().max()),
    )


def _magnitudes(
    u: torch.Tensor, rho: torch.Tensor, magnitude: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean squares ``M_j`` the targets take [k] and their ``rho_j`` [k], float64.

    The reached ``M_j = mean(u_j^2)``, or ``lambda_j^2 M_j`` (MATH.md 12): the norm's epsilon,
    ``M_j (1/rho_j - 1)``, stays, so ``rho_j`` becomes ``1 / (1 + (1/rho_j - 1) / lambda_j^2)``.
    """
    m = u.pow(2).mean(dim=1)  # [k]
    if magnitude is None:
        return m, rho
    lam2 = magnitude.double().flatten().pow(2)  # [k]
    return m * lam2, torch.where(rho > 0, 1.0 / (1.0 + (1.0 / rho - 1.0) / lam2), rho)


def _q_functions(ratio: bool, a2: torch.Tensor):
    """``q_of(gap) = q`` and ``dq_of(gap) = dq/dmu`` of the objective, element-wise [.., n]."""

    def q_of(gap: torch.Tensor) -> torch.Tensor:
        # ``gap.reciprocal()`` is ``1.0 / gap`` bit for bit (Tensor.__rdiv__ multiplies the
        # reciprocal by 1.0), one op fewer.
        return gap.reciprocal() if ratio else a2 / gap.pow(2)  # q_i = 1 / s'_i^2

    def dq_of(gap: torch.Tensor) -> torch.Tensor:
        return gap.pow(2).reciprocal() if ratio else 2.0 * a2 / gap.pow(3)

    return q_of, dq_of


def _solve_dual(
    tt: torch.Tensor, b: torch.Tensor, a2: torch.Tensor, d: int, objective: str
) -> tuple[torch.Tensor, int]:
    """Maximise the concave dual ``g(lam)`` of the chosen objective by damped Newton.

    With ``gap_i = a2_i - mu_i > 0``: ``ratio`` has ``q = 1/gap`` and
    ``g = b.lam + sum_i c_i log(gap_i / a2_i)``; ``nearest`` has ``q = a2/gap^2`` and
    ``g = b.lam - sum_i c_i a2_i / gap_i``. Both have ``grad g = b - T q``.

    Args:
        tt: squared targets on the support [k, n] (every column has a nonzero).
        b: right-hand sides ``d rho`` [k].
        a2: floored squared scales [n].
        d: model width (for messages).
        objective: ``ratio`` or ``nearest``.

    Returns:
        ``(lam [k], iterations)``, float64.

    Raises:
        ConditionError: the k RMS equations have no positive solution, or were not solved.
    """
    k = tt.shape[0]
    c = tt.sum(dim=0)  # [n]
    pi = tt / c  # [k, n]: columns on the simplex
    ratio = objective == "ratio"
    q_of, dq_of = _q_functions(ratio, a2)

    def dual(lam_: torch.Tensor) -> tuple[float, torch.Tensor]:
        gap = a2 - pi.T @ lam_  # [n]: a_i^2 - mu_i, > 0 on the domain
        if bool((gap <= 0).any()):
            return -math.inf, gap
        pen = (c * (gap / a2).log()).sum() if ratio else -(c * a2 / gap).sum()
        return float(b @ lam_ + pen), gap

    lam = own_multipliers(tt, b, a2, q_of, dq_of)
    if k == 1:  # alone, the position's own multiplier is the optimum, to the double's resolution
        rel = float(((tt @ q_of(a2 - lam) - b).abs() / b).max())  # pi = 1: mu_i = lambda
        if rel <= _ALONE:
            return lam, 0
    g, gap = dual(lam)
    vec = torch.eye(k, dtype=torch.float64, device=b.device)  # [k, k]
    rel, it = math.inf, 0
    while it < _MAX_ITER:
        it += 1
        q = q_of(gap)  # [n]
        res = tt @ q - b  # [k]: the k RMS equations' misses
        rel = float((res.abs() / b).max())
        if rel <= _TOL:
            break
        dq = dq_of(gap)  # [n]
        jac = (tt * dq) @ pi.T  # [k, k], symmetric positive semi-definite
        # Eigenvalues floored: along a null direction (positions with alike squared targets)
        # the dual is linear, and an unbounded one runs away to a Farkas certificate.
        ev, vec = torch.linalg.eigh(jac)  # [k], [k, k]
        ev = ev.clamp_min(1e-14 * max(float(ev.max()), 1e-300))
        step = vec @ ((vec.T @ -res) / ev)  # [k]: ascent direction of g
        slope = float(-res @ step)
        t_step, moved = 1.0, False
        for _ in range(60):  # backtracking: stay in the domain, Armijo on the concave dual
            g_new, gap_new = dual(lam + t_step * step)
            ok = math.isfinite(g_new) and g_new >= g + 1e-4 * t_step * slope
            if not ok and math.isfinite(g_new) and rel < 1e-2:
                # Near the optimum g's gain drowns in its rounding (terms c_i ~ t^2 reach 1e5):
                # there Newton converges on the equations themselves, so judge by them.
                res_new = tt @ q_of(gap_new) - b  # [k]
                ok = float((res_new.abs() / b).max()) < rel
            if ok:
                lam, g, gap, moved = lam + t_step * step, g_new, gap_new, True
                break
            t_step *= 0.5
        if not moved or float(lam.abs().max()) > 1e30:
            break
    if rel > 1e-7:  # float32's resolution: the normalised outputs are float32
        _refuse(tt, b, lam, vec, rel, it, d)
    return lam, it


def _refuse(
    tt: torch.Tensor,
    b: torch.Tensor,
    lam: torch.Tensor,
    vec: torch.Tensor,
    rel: float,
    it: int,
    d: int,
):
    """Raise with the reason: a Farkas certificate ``y`` (``T^T y >= 0``, ``b.y < 0``: no
    ``q >= 0`` has ``T q = b``) when one is found along the dual's run-away direction or a
    flat direction of its Hessian (``vec`` [k, k]), else the residual reached."""
    norm = float(lam.norm())
    cands = [-lam / norm] if norm > 0 else []
    cands += [sgn * vec[:, i] for i in range(vec.shape[1]) for sgn in (1.0, -1.0)]
    scale = float(tt.abs().max())
    for y in cands:  # [k]
        if float((tt.T @ y).min()) >= -1e-9 * scale and float(b @ y) < 0:
            raise ConditionError(
                f"no shared post-norm scale serves the {tt.shape[0]} query positions with their "
                f"MLP output magnitudes: with y = {[round(float(v), 4) for v in y]}, "
                f"sum_j y_j t_ji^2 >= 0 at all {d} coordinates but sum_j y_j d rho_j = "
                f"{float(b @ y):.4g} < 0 (Farkas: the positions' squared targets are too alike "
                "for their normalised outputs' RMS under one scale)"
            )
    raise ConditionError(
        f"shared post-norm scale: the {tt.shape[0]} RMS conditions are still off by "
        f"{rel:.3g} (relative) after {it} Newton steps (|lambda| {norm:.3g})"
    )


@dataclass(frozen=True)
class SharedScaleFit(ScaleMove):
    """Result of :func:`fit_shared_scale`: a :class:`ScaleMove` shared by k positions.

    Attributes (besides :class:`ScaleMove`'s; ``min_divisor`` is here the smallest
    ``sqrt(sum_j f_ji^2)`` divided by, on coordinates that move):
        max_miss: largest ``|t_ji - (s_i + ds_i) f_ji|`` left in float32 arithmetic.
    """

    max_miss: float = 0.0


def fit_shared_scale(
    s: torch.Tensor,
    f: torch.Tensor,
    t: torch.Tensor,
    tol: torch.Tensor | None = None,
    allow_unreached: bool = False,
) -> SharedScaleFit:
    """The scale change from the outputs the patched MLP actually produces (MATH.md 7, 8).

    One scale cannot be re-fit per position: ``s_i + ds_i`` is the least-squares fit
    ``sum_j f_ji t_ji / sum_j f_ji^2`` over the k positions (for k = 1 the exact ``t / f``).

    Args:
        s: current effective scale [d].
        f: normalised MLP outputs reached after the output move [k, d].
        t: wanted products [k, d].
        tol: per-coordinate change [d] too small to matter; default 0.
        allow_unreached: leave coordinates with ``f_ji = 0`` at every position unchanged and
            count them instead of raising (low precision).

    Raises:
        ConditionError: such an unreachable coordinate, or a non-finite result.
    """
    s, f, t = s.float(), f.float(), t.float()  # [d], [k, d], [k, d]
    den = f.pow(2).sum(dim=0)  # [d]
    zero = den == 0
    miss = (t - s * f).abs().amax(dim=0)  # [d]
    bad = zero & (miss > (0.0 if tol is None else tol))
    if bool(bad.any()) and not allow_unreached:
        i = int(torch.nonzero(bad)[0])
        raise ConditionError(
            f"normalised MLP output is exactly 0 at every query position at {int(bad.sum())} "
            f"coordinate(s) (first: {i}, needed change {float(miss[i]):.3g}): the scale cannot "
            "reach it"
        )
    fit = (f * t).sum(dim=0) / torch.where(zero, torch.ones_like(den), den)  # [d]
    new = torch.where(zero, s, fit)  # [d]
    ds = new - s  # [d]
    if not bool(torch.isfinite(ds).all()):
        raise ConditionError("scale change is not finite (|f| underflows)")
    nz = den[~zero].sqrt()
    return SharedScaleFit(
        ds=ds,
        min_divisor=float(nz.min()) if nz.numel() else 0.0,
        max_change=float(ds.abs().max()),
        max_gain=float(new.abs().max()),
        max_miss=float((t - new * f).abs().max()),
        unreached=int(bad.sum()),
        max_unreached=float(miss[bad].max()) if bool(bad.any()) else 0.0,
    )
