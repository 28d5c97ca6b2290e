"""Analysis: the MLP core whose outer linear is a given linear site, or why there is none.

An MLP core is an outer linear whose input ``h`` is computed, without mixing tokens, from the
outputs of inner linears that all read one input ``z`` (through reshapes; the router and the
expert banks of an MoE read it too). It is found by walking upstream from ``h`` and stopping at
the first linears met; the walk fails when it mixes tokens or reaches linears that read other
tensors (an attention output projection, the LM head), and says where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import fx

from ctxc.passes.locate.block_map import LinearSite, Rejection
from ctxc.passes.locate.graph_view import GraphView, op_name
from ctxc.passes.locate.match_linears import routing_nodes

__all__ = ["MlpCore", "common_module", "find_mlp_core"]

_CORE_LIMIT = 400  # nodes: an MLP's inner function is small; stop walks that leak out of it


@dataclass(frozen=True)
class MlpCore:
    """An outer linear and the inner linears that feed it from one input.

    Attributes:
        outer: the outer linear.
        z: the tensor every inner linear reads.
        inner: the first linears met upstream of the outer linear's input, in graph order.
        path: the innermost module holding all of them (the MLP's path).
    """

    outer: LinearSite
    z: fx.Node
    inner: tuple[LinearSite, ...]
    path: str


def find_mlp_core(
    view: GraphView, site: LinearSite, sites: dict[fx.Node, LinearSite]
) -> MlpCore | Rejection:
    """The MLP core whose outer linear is ``site``.

    Args:
        view: the graph.
        site: the candidate outer linear.
        sites: every linear site of the graph, keyed by output node.

    Returns:
        the core, or a :class:`Rejection` at ``site``'s module saying where the walk up from its
        input stopped and why.
    """
    starts = [view.by_name[site.input]]
    if site.experts:
        starts += routing_nodes(view, site)
    own = view.by_name[site.node]
    seen: set[fx.Node] = set()
    frontier: dict[fx.Node, LinearSite] = {}
    source: fx.Node | None = None
    stack = list(starts)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > _CORE_LIMIT:
            return _miss(site, f"walking up from its input passed {_CORE_LIMIT} ops")
        if n in sites and n is not own:
            found = sites[n]
            src = view.by_name[found.source]
            if source is not None and src is not source:
                first = next(iter(frontier.values()))
                return _miss(
                    site,
                    f"the linears upstream of its input ({first.module}, {found.module}) read "
                    "different tensors, not one MLP input",
                )
            source = src
            frontier[n] = found
            if found.experts:  # the bank's rows are chosen by the router: walk it too
                stack += routing_nodes(view, found)
            continue
        if n.op == "placeholder":
            return _miss(site, "walking up from its input reached the model input, no linear")
        if view.is_token_mixing(n):
            where = view.module_path(n) or "-"
            return _miss(
                site, f"walking up from its input met a token mixer ({op_name(n)} in {where})"
            )
        stack.extend(a for a in view.value_args(n) if a in view.input_dependent)
    if source is None:
        return _miss(site, "no linear upstream of its input")
    inner = tuple(sorted(frontier.values(), key=lambda s: view.index[view.by_name[s.node]]))
    path = common_module([s.module for s in (*inner, site)]) or view.module_path(own)
    return MlpCore(outer=site, z=source, inner=inner, path=path)


def common_module(paths: Iterable[str]) -> str:
    """The innermost module holding every path: their longest common dotted prefix.

    Args:
        paths: module paths.

    Returns:
        the prefix ("" when they share none, or for no paths).
    """
    split = [p.split(".") for p in paths]
    if not split:
        return ""
    common = []
    for components in zip(*split, strict=False):
        if len(set(components)) != 1:
            break
        common.append(components[0])
    return ".".join(common)


def _miss(site: LinearSite, why: str) -> Rejection:
    return Rejection(site.module or site.node, f"not the outer linear of an MLP: {why}")
