"""Analysis: what reports say about a located block, found once from the graph.

``ctxc inspect`` names nodes by module path and op kind (stable across exports, unlike fx node
names), tells a fused gate/up projection and a gated shared expert apart, and gives parameter
shapes. The locator computes these facts here and stores them on the :class:`MlpBlock`, so a
report reads the block and never walks the graph itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import fx

from ctxc.passes.locate.block_map import LinearSite, NodeLabel, NormSite, StepKind, TailStep, Term
from ctxc.passes.locate.graph_view import VIEW_LIKE, GraphView, op_name

__all__ = ["is_fused_gate_up", "is_gated", "label_tail", "node_label", "param_shapes"]

aten = torch.ops.aten

_SPLITS = frozenset({aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default})


def node_label(view: GraphView, node: fx.Node) -> NodeLabel:
    """How reports name ``node``: its module path and op kind.

    Args:
        view: the graph.
        node: any node.

    Returns:
        the label (``("", "parameter")`` for a placeholder).
    """
    if node.op == "placeholder":
        return NodeLabel("", "parameter")
    return NodeLabel(view.module_path(node), op_name(node))


def is_fused_gate_up(view: GraphView, plain: list[LinearSite]) -> bool:
    """Is the only plain inner linear's output split in two (one fused gate/up projection)?

    Args:
        view: the graph.
        plain: the block's inner linears that are neither routers nor expert banks.

    Returns:
        True for Phi-3's ``gate_up_proj`` (``chunk`` or ``split`` within a few reshapes).
    """
    if len(plain) != 1:
        return False
    node = view.by_name[plain[0].node]
    for _ in range(4):
        users = view.tensor_users(node)
        if len(users) != 1:
            return False
        node = users[0]
        if node.target in _SPLITS:
            return True
        if node.target not in VIEW_LIKE and not view.keeps_rows(node):
            return False
    return False


def is_gated(view: GraphView, site: LinearSite) -> bool:
    """Is the linear's output multiplied (by a per-row gate) before it is summed?

    Args:
        view: the graph.
        site: a linear inside the branch (a shared expert's output map).

    Returns:
        True when a product follows it within a few reshapes.
    """
    node = view.by_name[site.node]
    for _ in range(4):
        users = view.tensor_users(node)
        if len(users) != 1:
            return False
        node = users[0]
        if node.target == aten.mul.Tensor:
            return True
        if node.target not in VIEW_LIKE and not view.keeps_rows(node):
            return False
    return False


def label_tail(
    view: GraphView, tail: Iterable[TailStep], residual_in: str, residual_add: str
) -> tuple[TailStep, ...]:
    """The block's tail with what each ``add`` and ``gate`` step's other operand is.

    Args:
        view: the graph.
        tail: the steps from the control point to the residual add.
        residual_in: fx node of the residual input ``v``.
        residual_add: fx node of the block's add ``y``.

    Returns:
        the same steps, with ``origin``, ``term`` and ``mixes_tokens`` filled in.
    """
    out = []
    for step in tail:
        if step.kind == StepKind.GATE and step.side is not None:
            step = replace(step, origin=node_label(view, view.by_name[step.side]))
        elif step.kind == StepKind.ADD and step.side is not None:
            step = _label_add(view, step, residual_in, residual_add)
        out.append(step)
    return tuple(out)


def param_shapes(
    view: GraphView, sites: Iterable[LinearSite], norm: NormSite | None
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The shapes of the linears' weights and of the post norm's scale and bias.

    Args:
        view: the graph.
        sites: the block's linears.
        norm: its post norm, if any.

    Returns:
        ``(parameter name, shape)`` pairs, each name once, in the order given.
    """
    names = [s.weight for s in sites]
    if norm is not None and norm.scale is not None:
        names.append(norm.scale.param)
    if norm is not None and norm.bias is not None:
        names.append(norm.bias)
    placeholder = {name: node for node, name in reversed(view.param_of.items())}
    return tuple(
        (name, tuple(s or 0 for s in view.shape(view.by_name[placeholder[name]]) or ()))
        for name in dict.fromkeys(names)
    )


def _label_add(view: GraphView, step: TailStep, residual_in: str, residual_add: str) -> TailStep:
    """An ``add`` step labelled: a bias, the residual (named by what it carries), or a term."""
    assert step.side is not None
    side = view.by_name[step.side]
    at_residual = step.node == residual_add
    shown = view.row_source(side) if at_residual else side  # the residual through casts
    if side.op == "placeholder":
        term = Term.BIAS
    elif at_residual:
        term = Term.RESIDUAL
    else:
        term = Term.OTHER
    mixes = False
    if term == Term.OTHER:
        between = view.ancestors(side) & view.descendants(view.by_name[residual_in])
        mixes = any(view.is_token_mixing(n) for n in between)
    return replace(step, origin=node_label(view, shown), term=term, mixes_tokens=mixes)
