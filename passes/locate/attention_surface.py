"""Analysis: the attention output projection behind a post norm, a block's second linear surface.

In a sandwich-norm block (Gemma 2/3, OLMo 2) the residual update is
``post_attn_norm(o_proj(a)) + post_ffn_norm(down(h))``: the ``lora`` rule, which may move linear
weights only, reaches the block output through both (MATH.md 10). The projection is found the
way an MLP's tail is (:func:`~ctxc.passes.locate.follow_tail.follow_tail`): from its output,
through the norm and its scale, to the add that takes the residual back in, and that add must be
the MLP block's own residual ``v``.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx

from ctxc.passes.locate.block_map import (
    AttentionSurface,
    LinearSite,
    MlpBlock,
    Rejection,
    StepKind,
    TailStep,
)
from ctxc.passes.locate.choose_control import choose_control
from ctxc.passes.locate.find_mlp_core import MlpCore
from ctxc.passes.locate.follow_tail import Tail, follow_tail
from ctxc.passes.locate.graph_view import GraphView

__all__ = ["attention_surfaces", "with_attention"]


def attention_surfaces(
    view: GraphView, candidates: Iterable[LinearSite]
) -> dict[fx.Node, AttentionSurface]:
    """Every linear among ``candidates`` that reaches a residual add only through a scaled RMS
    norm, keyed by that add (pure).

    Args:
        view: the graph.
        candidates: linear sites that are no MLP's outer linear (attention projections, heads).

    Returns:
        residual add ``v`` -> its :class:`AttentionSurface`.
    """
    found: dict[fx.Node, AttentionSurface] = {}
    for site in candidates:
        if site.experts:
            continue
        core = MlpCore(site, view.by_name[site.input], (), site.module)
        tail = follow_tail(view, core)
        if isinstance(tail, Tail) and (surface := _surface(tail)) is not None:
            found[tail.y] = surface
    return found


def _surface(tail: Tail) -> AttentionSurface | None:
    """The surface ``tail`` describes, or None when it is not ``x + s * norm(W a)`` alone."""
    control = choose_control(tail)
    norm = tail.norm
    if isinstance(control, Rejection) or norm is None or norm.scale is None:
        return None
    if control.kind != "scale" or not control.stable_ok or norm.bias:
        return None
    if not _only_views_then_residual(control.tail) or control.tail[-1].side != tail.v.name:
        return None  # the residual taken back scaled (Beam): v is not x + the branch
    return AttentionSurface(tail.core.outer, norm, tail.y.name, tail.v.name, control.gain)


def _only_views_then_residual(steps: tuple[TailStep, ...]) -> bool:
    """The steps are casts, copies and constant gains, then the one add of the residual."""
    *views, last = steps or (TailStep(StepKind.VIEW, ""),)
    return last.kind == StepKind.ADD and all(s.kind in _PLAIN for s in views)


_PLAIN = (StepKind.VIEW, StepKind.GAIN)


def with_attention(
    view: GraphView, block: MlpBlock, surfaces: dict[fx.Node, AttentionSurface]
) -> AttentionSurface | None:
    """The surface that makes ``block``'s residual ``v``, when the block can use it.

    Only a dense block whose output is ``v + s_f * norm(down(h))`` (its post-norm scale is the
    output control, nothing else is added): then ``y = x + s_a * f_a + s_f * f_f`` and the two
    normalised outputs are all the ``lora`` rule sets (MATH.md 10).
    """
    if block.experts is not None or any(s.experts for s in block.inner) or block.others:
        return None
    if block.output_control != "scale" or not block.stable_ok or block.parallel:
        return None
    if not _only_views_then_residual(block.tail) or block.tail[-1].side != block.residual_in:
        return None  # y is not v + the branch (a scaled residual)
    v = view.by_name[block.residual_in]
    return surfaces.get(v) or surfaces.get(view.see_through(v))
