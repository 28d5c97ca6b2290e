"""One block's moves, computed from the tensors the reduced run reached (MATH.md 1, 2, 4, 8).

Pure functions over float32 tensors (rows are query positions) built on :mod:`primitive_moves`;
the driver (:mod:`ctxc.passes.solver.solve`) fetches the values, puts the deltas in place and
recomputes.
Each raises :class:`ConditionError` with the offending value when its condition fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ctxc.passes.locate.block_map import LinearSite, MlpBlock, TailStep
from ctxc.passes.runtime.delta_actions import row_experts
from ctxc.passes.solver.multi_scale import SharedScaleFit, fit_shared_scale
from ctxc.passes.solver.output_magnitude import (
    choose_magnitude,
    least_rounding_targets,
    rounding_gain,
)
from ctxc.passes.solver.primitive_moves import (
    ConditionError,
    ScaleMove,
    input_move,
    linear_output_move,
    right_inverse,
    scale_output_move,
    stable_post_norm_target,
)
from ctxc.patch import Delta

__all__ = [
    "ExpertFactors",
    "bank_delta",
    "bank_input_move",
    "control_target",
    "experts_output_move",
    "input_moves",
    "outer_move",
    "output_reads",
    "row_tokens",
    "scale_move",
    "shared_scale_move",
]

# Per expert of a bank: (expert, u [out, r], v [in, r]).
ExpertFactors = list[tuple[int, torch.Tensor, torch.Tensor]]


def input_moves(
    weights: Sequence[torch.Tensor], z: torch.Tensor, z_target: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Input move of every linear that reads ``z`` (MATH.md 1): ``(W + dW) z = W z_C``.

    Args:
        weights: each linear's weight [out, in], in the model's dtype.
        z: the input reached [k, in].
        z_target: the full run's input [k, in].

    Returns:
        ``(u, v)`` per weight: u [out, k], v [in, k], float32.
    """
    z_pinv = right_inverse(z, "MLP input z")  # [in, k], shared by every linear
    return [input_move(w, z, z_target, z_pinv) for w in weights]


def bank_input_move(
    bank: torch.Tensor,
    site: LinearSite,
    ids: torch.Tensor | Sequence[torch.Tensor],
    tokens: torch.Tensor | None,
    z: torch.Tensor,
    z_target: torch.Tensor,
) -> ExpertFactors:
    """Input move of every active expert of a stacked bank that reads ``z`` (MATH.md 2, MoE).

    Args:
        bank: the bank's weights [E, ., .].
        site: the bank's site (its layout, and ``repeat`` rows per query position).
        ids: the value of ``site.experts``: each row's expert, or a split's chunks
            (:func:`~ctxc.passes.runtime.delta_actions.row_experts`).
        tokens: the value of ``site.tokens`` (each row's query position), or None.
        z: the input reached [k, in].
        z_target: the full run's input [k, in].

    Returns:
        per active expert, ascending: ``(e, u [out, n_e], v [in, n_e])``.
    """
    ids = row_experts(ids)  # [rows]
    tokens = row_tokens(len(ids), site.repeat, tokens)  # [rows]
    out: ExpertFactors = []
    for e in sorted(set(ids.tolist())):
        mine = torch.unique(tokens[ids == e])
        ze = z[mine]  # [n_e, in]
        pinv = right_inverse(ze, f"MLP input z of expert {e}")  # [in, n_e]
        w = bank[e].T if site.layout == "in_out" else bank[e]  # [out, in]
        u, v = input_move(w, ze, z_target[mine], pinv)
        out.append((e, u, v))
    return out


def row_tokens(rows: int, repeat: int, tokens: torch.Tensor | None) -> torch.Tensor:
    """Each bank row's query position [rows], int64: ``tokens`` when the graph gathers token
    rows by index (JetMoE), else ``repeat`` consecutive rows per position."""
    if tokens is not None:
        return tokens.reshape(-1).long()
    return torch.arange(rows) // repeat


def control_target(
    y_target: torch.Tensor, tail: Sequence[tuple[TailStep, torch.Tensor | None]]
) -> torch.Tensor:
    """The value [k, d] the output-controlled part must take so that the block gives ``y_C``.

    Args:
        y_target: the full run's block output [k, d].
        tail: the steps from the controlled value to the residual add, in graph order, each
            with the value [k, d] (``add``) or [k, 1] (``gate``) of its other operand.

    Returns:
        the wanted value [k, d], float32 (MATH.md 1: ``d = y_C - v - ...``).
    """
    t = y_target.float()  # [k, d]
    for step, side in reversed(tail):
        if step.kind == "add":
            assert side is not None
            t = t - side.float()  # [k, d]
        elif step.kind == "gain":
            t = t / step.factor
        elif step.kind == "gate":
            assert side is not None
            g = side.float()  # [k, 1]
            if bool((g == 0).any()):
                raise ConditionError(
                    f"the branch gate is 0 at {int((g == 0).sum())} query position(s): "
                    "nothing behind it reaches the output"
                )
            t = t / g
    return t


def outer_move(residual: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output move on an outer linear adding ``residual`` [k, out] to its output (MATH.md 1).

    Args:
        residual: wanted change of the linear's output [k, out].
        h: the linear's input [k, in].

    Returns:
        ``(u [out, k], v [in, k])``, float32.
    """
    h_pinv = right_inverse(h, "MLP activation h")  # [in, k]
    return linear_output_move(residual, h, h_pinv)


def scale_move(
    s: torch.Tensor,
    t: torch.Tensor,
    y_target: torch.Tensor,
    u_now: torch.Tensor | None,
    reach: Callable[[torch.Tensor | None], torch.Tensor],
    summed: torch.Tensor | None = None,
    stable: bool = True,
) -> ScaleMove:
    """Output move on a post norm's scale ``s`` (MATH.md 2), after the stable rule's linear move.

    With ``stable`` (MATH.md 4) the outer linear first moves its output toward the unit-RMS
    vector nearest the target, at the magnitude of least rounding (MATH.md 12); the scale then
    takes the bounded remainder.

    Args:
        s: the effective scale [d], float32.
        t: the value [1, d] the scaled product must take (:func:`control_target`).
        y_target: the full run's block output [d], in the model's dtype.
        u_now: the outer linear's output reached [1, d], float32; None: the scale alone moves
            and no rounding figure is given.
        reach: puts the outer linear's move adding the given residual [1, d] in place (None:
            no move) and returns the normalised output ``f`` [1, d] the patched MLP now gives.
        summed: the outer sums' terms ``m`` [1, d] (:func:`summed_terms`): the magnitude is
            chosen and the figure given; None: the reached magnitude is kept.
        stable: move the outer linear first (False: the standard rule, the scale alone).

    Returns:
        the :class:`ScaleMove`: ``ds`` [d] and its figures.
    """
    residual, lam = None, 1.0
    r = u_now.double().pow(2).mean().sqrt() if u_now is not None else None  # rms(u)
    if u_now is not None and r is not None and stable:
        target = stable_post_norm_target(s, t[0], u_now[0])  # [d], at rms(u)
        if summed is not None:
            w = target.double() / r  # [d]: s' ~ t / w where w moves (MATH.md 12)
            gain = torch.where(w != 0, t[0].double() / w, s.double()).abs() / r  # [d]
            peak = target.abs().amax()[None]
            lam = float(choose_magnitude(gain, summed, t, peak, y_target.dtype)[0])
        residual = (lam * target)[None] - u_now  # [1, d]
    # The scale change from the output the patched MLP actually produces (MATH.md 8).
    f = reach(residual)  # [1, d]
    # The block output is rounded to the model's dtype: a change below its spacing at y_C
    # cannot show. In low precision a zero f_i is rounding (the patched u_i cancelled to
    # 0): leave that coordinate, count the miss, and let the next block absorb it.
    tol = torch.finfo(y_target.dtype).eps * y_target.float().abs()  # [d]
    low = y_target.dtype != torch.float32
    move = scale_output_move(s, f[0], t[0], tol, allow_unreached=low)
    if summed is None or r is None:
        return move
    gain = (s + move.ds).double().abs() / r  # [d], at the reached magnitude
    figure = rounding_gain(gain, summed, t, [lam])
    return dataclasses.replace(move, magnitude=lam, rounding_gain=figure)


def shared_scale_move(
    s: torch.Tensor,
    t: torch.Tensor,
    y_target: torch.Tensor,
    u_now: torch.Tensor,
    f_now: torch.Tensor,
    reach: Callable[[torch.Tensor | None], torch.Tensor],
    summed: torch.Tensor | None = None,
) -> SharedScaleFit:
    """k query positions, one scale: the outer linear sets each position's normalised output
    ``t_j / s'``, then ``s'`` is fitted to what the patched MLP produces (MATH.md 9).

    Each ``u*_j`` takes the magnitude of least rounding (MATH.md 12): the least-change scale is
    solved at the reached magnitudes, its gains give :func:`choose_magnitude`'s factors, and
    where one is above 1 the scale is solved again at the new magnitudes.

    Args:
        s: the effective scale [d], float32.
        t: the values [k, d] the scaled product must take.
        y_target: the full run's block outputs [k, d], in the model's dtype.
        u_now: the outer linear's output reached [k, d], float32.
        f_now: the normalised output reached [k, d].
        reach: as for :func:`scale_move`.
        summed: the outer sums' terms ``m`` [k, d]; None: the reached magnitudes are kept.

    Returns:
        the :class:`SharedScaleFit`: ``ds`` [d] and its figures.
    """
    rho = f_now.double().pow(2).mean(dim=1)  # [k]: M / (M + eps)
    r = (u_now.double().pow(2).mean(dim=1) / rho).sqrt()  # [k]: r(u_j) = sqrt(M_j + eps)
    shared, lam = least_rounding_targets(s, t, u_now, rho, summed, y_target.dtype)
    f = reach(shared.targets - u_now)  # [k, d], recomputed (MATH.md 8)
    tol = (torch.finfo(y_target.dtype).eps * y_target.float().abs()).amax(dim=0)  # [d]
    low = y_target.dtype != torch.float32
    fit = fit_shared_scale(s, f, t, tol, allow_unreached=low)
    if lam is None or summed is None:  # both None together (least_rounding_targets)
        return fit
    gain = (s + fit.ds).double().abs()[None] / r[:, None]  # [k, d], at the reached magnitudes
    figure = rounding_gain(gain, summed, t, lam.tolist())
    return dataclasses.replace(fit, magnitude=float(lam.max()), rounding_gain=figure)


def experts_output_move(
    d: torch.Tensor,
    ids: torch.Tensor,
    gates: torch.Tensor,
    h: torch.Tensor,
    top_k: int,
    tokens: torch.Tensor | None = None,
) -> tuple[float, ExpertFactors]:
    """Every active expert's output map takes ``d / S`` (MATH.md 1, MoE).

    Args:
        d: wanted change of the experts' per-token sum [k, d].
        ids: expert of each bank row [rows].
        gates: routing weight of each bank row [rows], float32.
        h: each bank row's activation [rows, d_ff], float32.
        top_k: rows per token, consecutive (when ``tokens`` is None).
        tokens: query position of each bank row [rows], for rows in any order (JetMoE sorts
            them by expert and sums them by ``index_add``).

    Returns:
        the smallest ``|S|``, and per active expert ``(e, u [d, n_e], v [d_ff, n_e])``.
    """
    if tokens is None:
        gate_sum = gates.view(-1, top_k).sum(dim=1)  # [k]
        tokens = torch.arange(gates.numel()) // top_k
    else:
        gate_sum = gates.new_zeros(d.shape[0]).index_add(0, tokens, gates)  # [k]
    min_gate_sum = float(gate_sum.abs().min())
    if bool((gate_sum == 0).any()):
        i = int((gate_sum == 0).nonzero()[0])
        raise ConditionError(
            f"gate sum S = 0 at query position {i} (routing weights "
            f"{gates[tokens == i].tolist()}): the experts' output move divides by it"
        )
    out: ExpertFactors = []
    for e in sorted(set(ids.tolist())):
        rows = (ids == e).nonzero().flatten()  # bank rows routed to e
        mine = tokens[rows]
        wanted = d[mine] / gate_sum[mine, None]  # [n_e, d]
        he = h[rows]  # [n_e, d_ff]
        pinv = right_inverse(he, f"activation h of expert {e}")  # [d_ff, n_e]
        u, v = linear_output_move(wanted, he, pinv)
        out.append((e, u, v))
    return min_gate_sum, out


def bank_delta(site: LinearSite, block: str, factors: ExpertFactors) -> Delta:
    """One delta for the listed experts of a bank, factors zero-padded to a common rank."""
    r = max(u.shape[1] for _, u, _ in factors)
    u = torch.stack([F.pad(x, (0, r - x.shape[1])) for _, x, _ in factors])  # [n, out, r]
    v = torch.stack([F.pad(x, (0, r - x.shape[1])) for _, _, x in factors])  # [n, in, r]
    experts = tuple(e for e, _, _ in factors)
    return Delta(site.weight, block, u=u, v=v, layout=site.layout, experts=experts)


def output_reads(block: MlpBlock) -> set[str]:
    """The nodes whose values the output move reads at ``y``.

    The reduced run keeps them as computed: later in-place ops may change them (Falcon adds the
    attention output into the MLP output with ``add_``). The outer linear's output is among them:
    the solver reads the output it reached there instead of computing it again.
    """
    keep = {block.activation, block.control, block.outer.node}
    keep.update(s.side for s in block.tail if s.side is not None)
    if block.norm is not None:
        keep.add(block.norm.input)
        if block.scale is not None and block.scale.normalized:
            keep.add(block.scale.normalized)
    if block.attention is not None:  # the lora rule's second surface (MATH.md 10)
        att = block.attention
        keep.update({att.residual, att.site.node, att.site.input, att.norm.input})
        if att.scale.normalized:
            keep.add(att.scale.normalized)
    if block.experts is not None:
        assert block.outer.experts is not None
        keep.update({block.experts.gate, block.experts.combine, block.outer.experts})
        keep.update(t for t in (block.experts.tokens, block.outer.tokens) if t)
    return keep
