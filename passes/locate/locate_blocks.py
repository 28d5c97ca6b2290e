"""Analysis: find every residual MLP block in a traced decoder, from ops and data flow.

A block is recognised by what it computes, never by ``model_type`` (DESIGN.md), in three steps:

1. Linear maps, one matcher per way a model writes one (:mod:`match_linears`).
2. For each linear, the MLP core it would be the outer linear of: the inner linears that feed
   it from one input ``z`` without mixing tokens (:mod:`find_mlp_core`).
3. Each core's tail, the ops from its output to the residual add, which the solver must be able
   to invert (:mod:`follow_tail`). Cores that end at the same add form one block (an MoE's
   experts and its shared expert).

Every core whose tail cannot be inverted is a :class:`Rejection` with the reason (MATH.md 5:
a post norm with no trainable scale or bias has a fixed RMS, so no patch reaches the target).
When no block is found at all, every decoder layer says where the search stopped: a
:class:`Rejection` for each candidate linear of a layer that has no rejection of its own.
"""

from __future__ import annotations

import dataclasses

from torch import fx

from ctxc.frontend.trace import TracedModel
from ctxc.passes.locate.attention_surface import attention_surfaces, with_attention
from ctxc.passes.locate.block_map import (
    AttentionSurface,
    BlockMap,
    LinearSite,
    MlpBlock,
    Rejection,
)
from ctxc.passes.locate.branch_scope import not_a_branch, unmatched_weights
from ctxc.passes.locate.choose_control import choose_control
from ctxc.passes.locate.describe_block import (
    is_fused_gate_up,
    is_gated,
    label_tail,
    node_label,
    param_shapes,
)
from ctxc.passes.locate.find_mlp_core import MlpCore, find_mlp_core
from ctxc.passes.locate.follow_tail import Tail, follow_tail
from ctxc.passes.locate.graph_view import ELEMENTWISE, GraphView
from ctxc.passes.locate.match_linears import find_linear_sites, routing_nodes
from ctxc.passes.locate.match_norms import is_norm_output, trailing_norm

__all__ = ["locate_blocks"]


def locate_blocks(traced: TracedModel, view: GraphView | None = None) -> BlockMap:
    """Find the residual MLP blocks of ``traced`` and explain every candidate it rejects.

    Args:
        traced: the exported model.
        view: a :class:`GraphView` of it, when the caller already has one.

    Returns:
        a frozen :class:`BlockMap`; the graph is not modified.
    """
    view = view or GraphView(traced)
    sites = find_linear_sites(view)
    tails: list[Tail] = []
    failed: list[tuple[MlpCore, Rejection]] = []
    misses: dict[fx.Node, Rejection] = {}
    for node, site in sites.items():
        core = find_mlp_core(view, site, sites)
        if isinstance(core, Rejection):
            misses[node] = core
            continue
        found = follow_tail(view, core)
        if isinstance(found, Rejection):
            failed.append((core, found))
        else:
            tails.append(found)
    groups: dict[fx.Node, list[Tail]] = {}
    for tail in tails:
        groups.setdefault(tail.y, []).append(tail)
    blocks: list[MlpBlock] = []
    rejections: list[Rejection] = []
    surfaces = attention_surfaces(view, (sites[n] for n in misses))
    for y in sorted(groups, key=view.index.__getitem__):
        found_block = _assemble(view, groups[y], sites)
        if isinstance(found_block, MlpBlock):
            blocks.append(_with_surface(view, found_block, surfaces))
        else:
            rejections.append(found_block)
    # A core whose own tail fails but whose input feeds a located block is part of that block's
    # inner function (a shared expert): not a rejection of its own.
    # A core whose output reaches the residual stream only through a token mixer, or not at
    # all (an output head), is no block: a note (branch_scope.py).
    covered = {b.mlp_in for b in blocks}
    notes: list[Rejection] = []
    for core, rejection in failed:
        if core.z.name in covered or rejection in rejections:
            continue
        note = not_a_branch(view, core)
        if note is None:
            rejections.append(rejection)
        elif Rejection(core.path, note) not in notes:
            notes.append(Rejection(core.path, note))
    head = _locate_head(view, sites)
    # Misses explain a model with no block at all. Beside located blocks they are no failure: a
    # layer without an MLP needs no patch (the next block's target absorbs its difference).
    if not blocks:
        if head is not None:  # the LM head is no candidate block
            misses.pop(view.by_name[head], None)
        rejections += _unexplained(unmatched_weights(view, sites), rejections)
        rejections += _unexplained([*notes, *misses.values()], rejections)
    rejections.sort(key=lambda r: _path_key(r.where))
    notes.sort(key=lambda r: _path_key(r.where))
    head_module = view.module_path(view.by_name[head]) if head else None
    return BlockMap(
        tuple(blocks), tuple(rejections), head=head, head_module=head_module, notes=tuple(notes)
    )


def _assemble(
    view: GraphView, tails: list[Tail], sites: dict[fx.Node, LinearSite]
) -> MlpBlock | Rejection:
    """One block from the cores that end at the same residual add."""
    # The output move goes where MATH.md 2 puts it: the experts' outputs for an MoE (a shared
    # expert is an ordinary MLP inside f), else the one core (a dense MLP).
    tails = sorted(
        tails, key=lambda t: (t.experts is None, view.index[view.by_name[t.core.outer.node]])
    )
    main = tails[0]
    core, y, z = main.core, main.y, main.core.z
    control = choose_control(main)
    if isinstance(control, Rejection):
        return control
    inner = _inner_sites(view, main, sites)
    chooses: set[fx.Node] = set()
    for site in inner:
        if site.experts:
            for node in routing_nodes(view, site):
                chooses |= view.ancestors(node) | {node}
    routers = tuple(s.node for s in inner if not s.experts and view.by_name[s.node] in chooses)
    others = tuple(t.core.outer for t in tails[1:] if t.core.z is z and t.core.outer not in inner)
    mixers = [n for n in view.ancestors(y) & view.descendants(main.v) if view.is_token_mixing(n)]
    z_is_norm = view.row_source(main.v) is not z and is_norm_output(view, z)
    plain = [s for s in inner if not s.experts and s.node not in routers]
    labelled = [view.row_source(main.v), z, view.by_name[core.outer.input], y]
    names = [main.v.name, z.name, core.outer.input, y.name]
    if main.experts is not None:
        labelled += [view.by_name[main.experts.gate], view.by_name[main.experts.combine]]
        names += [main.experts.gate, main.experts.combine]
    return MlpBlock(
        path=core.path,
        residual_in=main.v.name,
        residual_add=y.name,
        branch=main.branch.name,
        mlp_in=z.name,
        inner=inner,
        activation=core.outer.input,
        outer=core.outer,
        gain=control.gain,
        output_control=control.kind,
        control=control.node,
        tail=label_tail(view, control.tail, main.v.name, y.name),
        norm=main.norm,
        experts=main.experts,
        others=others,
        parallel=bool(mixers),
        pre_norm=view.module_path(z) if z_is_norm else None,
        trailing_norm=trailing_norm(view, y),
        stable_ok=control.stable_ok,
        routers=routers,
        fused_gate_up=is_fused_gate_up(view, plain),
        gated_others=tuple(is_gated(view, s) for s in others),
        labels=tuple(zip(names, (node_label(view, n) for n in labelled), strict=True)),
        param_shapes=param_shapes(view, (*inner, *others, core.outer), main.norm),
    )


def _with_surface(
    view: GraphView, block: MlpBlock, surfaces: dict[fx.Node, AttentionSurface]
) -> MlpBlock:
    """``block`` with the attention surface that makes its residual, if it can use one."""
    surface = with_attention(view, block, surfaces)
    if surface is None:
        return block
    shapes = block.param_shapes + param_shapes(view, (surface.site,), None)
    return dataclasses.replace(block, attention=surface, param_shapes=shapes)


def _inner_sites(
    view: GraphView, main: Tail, sites: dict[fx.Node, LinearSite]
) -> tuple[LinearSite, ...]:
    """Every linear that reads ``z`` and feeds ``y`` without a token mixer, in graph order."""
    core, z = main.core, main.core.z
    y_anc = view.ancestors(main.y)
    inner: list[LinearSite] = []
    for node, site in sites.items():
        if node not in y_anc or node is view.by_name[core.outer.node] or site.source != z.name:
            continue
        reach = [d for d in view.descendants(node) if d in y_anc]
        if any(view.is_token_mixing(d) for d in reach):
            continue  # attention's q/k/v of a parallel block also read z: not the MLP's
        inner.append(site)
    inner += [s for s in core.inner if s not in inner]
    return tuple(sorted(inner, key=lambda s: view.index[view.by_name[s.node]]))


def _unexplained(misses: list[Rejection], rejections: list[Rejection]) -> list[Rejection]:
    """The misses of every decoder layer that has no rejection of its own."""
    explained = {_layer(r.where) for r in rejections}
    return [m for m in misses if _layer(m.where) not in explained]


def _layer(path: str) -> str:
    """The decoder layer of a module path: up to its first numeric component (``h.3``)."""
    components = path.split(".")
    for i, c in enumerate(components):
        if c.isdigit():
            return ".".join(components[: i + 1])
    return path


def _locate_head(view: GraphView, linears: dict[fx.Node, LinearSite]) -> str | None:
    """The LM head: a linear from which only element-wise ops lead to the output."""
    out = next(n for n in reversed(view.nodes) if n.op == "output")
    first = out.args[0]
    node = first[0] if isinstance(first, tuple | list) else first
    while isinstance(node, fx.Node):
        if node in linears:
            return node.name
        if node.op != "call_function" or node.target not in ELEMENTWISE:
            return None
        acts = [a for a in node.args if isinstance(a, fx.Node) and a in view.input_dependent]
        if len(acts) != 1:
            return None
        node = acts[0]
    return None


def _path_key(path: str) -> tuple[tuple[int, int | str], ...]:
    # Numbered components sort by number (layer 10 after layer 9), before named ones.
    return tuple((0, int(c)) if c.isdigit() else (1, c) for c in path.split("."))
