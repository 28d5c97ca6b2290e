"""The shared-scale dual's starting point (MATH.md 9): per-position bisections, batched.

:func:`~ctxc.passes.solver.multi_scale.shared_scale_targets` starts its Newton solve from each query
position's own multiplier, found by bisecting ``F_j(lam) = sum_i t_ji^2 q_i(a_i^2 - lam)``
against ``b_j`` for 120 halvings. Done one halving at a time that is a dozen tensor ops per
halving on [k, d] tensors, 120 times per block: at ``ctxc generate``'s one token per step, the
largest part of the solver's time (issue 11). Here the same halvings are taken several at a time:
the midpoints of the next levels of the bisection tree (every interval the halvings can reach,
computed in Python floats, which round as the tensors do: IEEE double) are evaluated in one
batched call, and the comparisons then pick the path. Each evaluated ``F`` is the same ops on
the same numbers, row by row (a row's sum does not depend on the other rows), so the result is
bit for bit the one-at-a-time bisection's. A position whose interval no longer changes has
reached a fixed point (a halving is a function of the interval alone) and stops early.
Analysis: nothing is mutated.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["HALVINGS", "bisect_start"]

HALVINGS = 120
_LEVELS = 5  # halvings per batched call: 2^5 - 1 = 31 midpoints per position


def bisect_start(
    tt: torch.Tensor,
    b: torch.Tensor,
    a2: torch.Tensor,
    q_of: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Each position's own multiplier, as if it were alone (``mu_i = lambda_j`` everywhere): a
    point of the dual's domain (``mu_i`` averages them) near the optimum; 1-D bisections.

    Args:
        tt: squared targets [k, n]; b: right-hand sides [k]; a2: floored squared scales [n];
        q_of: ``gap [.., n] -> q`` element-wise, increasing in ``lambda``.

    Returns:
        ``lambda`` [k], float64: the left end after :data:`HALVINGS` halvings.
    """
    big = tt > 0  # [k, n]
    inf = torch.full_like(tt, math.inf)
    top = torch.where(big, a2.expand_as(tt), inf).amin(dim=1)  # [k]: pole of each position
    hi = top.clone()
    lo = top - 1.0
    for _ in range(200):  # widen until the left end is under the target (q falls as gap grows)
        under = (tt * q_of(a2 - lo[:, None])).sum(dim=1) <= b  # [k]
        if bool(under.all()):
            break
        lo = torch.where(under, lo, top - 4.0 * (top - lo))
    ends = list(zip(lo.tolist(), hi.tolist(), strict=True))
    moving = [True] * len(ends)
    left = HALVINGS
    while left > 0 and any(moving):
        levels = min(_LEVELS, left)
        mids = [_tree(lo_j, hi_j, levels) for lo_j, hi_j in ends]  # [k][2^levels - 1]
        m = torch.tensor(mids, dtype=tt.dtype, device=tt.device)  # [k, M]
        f = (tt[:, None, :] * q_of(a2 - m[:, :, None])).sum(dim=-1)  # [k, M]
        over = (f > b[:, None]).tolist()
        for j in range(len(ends)):
            if moving[j]:
                ends[j], moving[j] = _walk(ends[j], mids[j], over[j], levels)
        left -= levels
    return torch.tensor([lo_j for lo_j, _ in ends], dtype=tt.dtype, device=tt.device)


def _tree(lo: float, hi: float, levels: int) -> list[float]:
    """The midpoints of every interval ``levels`` halvings of ``[lo, hi]`` can visit, in
    breadth-first order (node ``i``'s children: ``2i + 1`` keeps the left half, ``2i + 2``
    the right)."""
    out: list[float] = []
    level = [(lo, hi)]
    for _ in range(levels):
        nxt = []
        for a, c in level:
            mid = 0.5 * (a + c)  # as the tensor bisection rounds it
            out.append(mid)
            nxt += [(a, mid), (mid, c)]
        level = nxt
    return out


def _walk(
    ends: tuple[float, float], mids: list[float], over: list[bool], levels: int
) -> tuple[tuple[float, float], bool]:
    """Take ``levels`` halvings along the tree; the interval reached and whether it moves."""
    lo, hi = ends
    node = 0
    for _ in range(levels):
        mid = mids[node]
        new = (lo, mid) if over[node] else (mid, hi)
        if _same(new[0], lo) and _same(new[1], hi):  # a fixed point: every later halving
            return new, False  # gives it again
        lo, hi = new
        node = 2 * node + (1 if over[node] else 2)
    return (lo, hi), True


def _same(x: float, y: float) -> bool:
    """The same double, bit for bit (``0.0`` and ``-0.0`` differ; NaN is never the same)."""
    return x == y and math.copysign(1.0, x) == math.copysign(1.0, y)
