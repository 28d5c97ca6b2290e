"""Analysis: find every residual MLP block in a traced decoder, from ops and data flow.

A block is recognised by what it computes, never by ``model_type``: an ``add(v, branch)`` of two
activations where ``v`` is an ancestor of ``branch``, the branch mixes no tokens (no attention),
and it holds linear maps that read one common input ``z`` (inner, input-controllable) and one
linear whose output reaches the add through position-wise ops only (outer, output-controllable
through its weight, or through a trainable post-norm scale).
"""

from __future__ import annotations

import math

import torch
from torch import fx

from ctxc.passes.block_map import BlockMap, LinearSite, MlpBlock, Rejection, ScaleSite
from ctxc.passes.graph_view import ELEMENTWISE, VIEW_LIKE, GraphView, op_name
from ctxc.trace import TracedModel

__all__ = ["locate_blocks"]

aten = torch.ops.aten

_NORM_OPS = frozenset(
    {
        aten.pow.Tensor_Scalar,
        aten.mean.dim,
        aten.rsqrt.default,
        aten.sqrt.default,
        aten.mul.Tensor,
        aten.div.Tensor,
        aten.add.Tensor,
    }
)


def locate_blocks(traced: TracedModel, view: GraphView | None = None) -> BlockMap:
    """Find the residual MLP blocks of ``traced`` and explain every candidate it rejects.

    Args:
        traced: the exported model.
        view: a :class:`GraphView` of it, when the caller already has one.

    Returns:
        a frozen :class:`BlockMap`; the graph is not modified.
    """
    view = view or GraphView(traced)
    blocks: list[MlpBlock] = []
    rejections: list[Rejection] = []
    linears = {n: site for n in view.nodes if (site := _linear_site(view, n)) is not None}
    for add in view.nodes:
        pair = _residual_pair(view, add)
        if pair is None:
            continue
        v, branch = pair
        region = view.between(v, branch) | {branch}
        if any(view.is_token_mixing(n) for n in region):
            continue  # a mixer (attention) branch, not an MLP
        sites = [linears[n] for n in sorted(region, key=view.index.__getitem__) if n in linears]
        if not sites:
            continue
        found = _analyse_branch(view, add, v, branch, region, sites)
        (blocks if isinstance(found, MlpBlock) else rejections).append(found)
    return BlockMap(tuple(blocks), tuple(rejections), head=_locate_head(view, linears))


def _linear_site(view: GraphView, node: fx.Node) -> LinearSite | None:
    """A ``LinearSite`` when ``node`` multiplies an activation by a parameter matrix."""
    if node.op != "call_function" or node not in view.input_dependent:
        return None
    if node.target == aten.linear.default:
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        layout = "out_in"
    elif node.target == aten.addmm.default:  # GPT-2 Conv1D: addmm(bias, x, W[in, out])
        b, x, w = node.args[0], node.args[1], node.args[2]
        layout = "in_out"
    else:
        return None
    if not isinstance(w, fx.Node) or not isinstance(x, fx.Node):
        return None
    weight = view.param_root(w)
    if weight is None:
        return None
    bias = view.param_root(b) if isinstance(b, fx.Node) else None
    module = view.module_path(node)
    return LinearSite(
        node=node.name,
        input=x.name,
        weight=view.param_name(weight),
        bias=view.param_name(bias) if bias is not None else None,
        module=module,
        layout=layout,
    )


def _residual_pair(view: GraphView, add: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(v, branch)`` when ``add`` is ``v + branch`` with ``v`` upstream of ``branch``."""
    if add.op != "call_function" or add.target != aten.add.Tensor:
        return None
    a, b = add.args[0], add.args[1]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None
    if not (view.is_float_activation(a) and view.is_float_activation(b)):
        return None
    if view.shape(a) != view.shape(b) or len(view.shape(a) or ()) != 3:
        return None
    if a in view.ancestors(b):
        return a, b
    if b in view.ancestors(a):
        return b, a
    return None


def _analyse_branch(
    view: GraphView,
    add: fx.Node,
    v: fx.Node,
    branch: fx.Node,
    region: set[fx.Node],
    sites: list[LinearSite],
) -> MlpBlock | Rejection:
    nodes = {s.node: view.by_name[s.node] for s in sites}
    site_nodes = set(nodes.values())
    outer = [s for s in sites if not (view.descendants(nodes[s.node]) & site_nodes)]
    inner = [s for s in sites if not (view.ancestors(nodes[s.node]) & site_nodes)]
    where = _common_module(s.module for s in sites) or view.module_path(add)
    if len(outer) != 1:
        mods = ", ".join(s.module for s in outer)
        return Rejection(where, f"branch ends in {len(outer)} linear maps ({mods}); expected one")
    out = outer[0]
    if out in inner:
        return Rejection(where, "branch has a single linear map: no inner function to move")
    middle = [s for s in sites if s not in inner and s is not out]
    if middle:
        mods = ", ".join(s.module for s in middle)
        return Rejection(where, f"linear maps between the inner and outer ones ({mods})")
    inputs = {s.input for s in inner}
    if len(inputs) != 1:
        return Rejection(where, "inner linear maps read different inputs: no single input move")
    z = view.by_name[inner[0].input]
    u = nodes[out.node]
    tail = _analyse_tail(view, u, branch, where)
    if isinstance(tail, Rejection):
        return tail
    post_norm, scale, gain = tail
    return MlpBlock(
        path=where,
        residual_in=v.name,
        residual_add=add.name,
        branch=branch.name,
        mlp_in=z.name,
        inner=tuple(inner),
        activation=out.input,
        outer=out,
        post_norm=post_norm,
        scale=scale,
        gain=gain,
        output_control="scale" if scale is not None else "linear",
    )


def _analyse_tail(
    view: GraphView, u: fx.Node, branch: fx.Node, where: str
) -> tuple[str | None, ScaleSite | None, float] | Rejection:
    """Classify what lies between the outer linear's output ``u`` and the branch output."""
    tail = sorted(view.between(u, branch) | {branch}, key=view.index.__getitem__)
    if u is branch:
        tail = []
    norm_nodes = [n for n in tail if n.target in (aten.rsqrt.default, aten.sqrt.default)]
    post_norm = None
    scale = None
    gain = 1.0
    for n in tail:
        if n.op != "call_function" or n.target not in VIEW_LIKE | _NORM_OPS:
            return Rejection(where, f"outer function has op {op_name(n)}: not output-controllable")
    if norm_nodes:
        post_norm = view.module_path(norm_nodes[0]) or where
        scale = _find_scale(view, tail, norm_nodes[0])
        if scale is None:
            return Rejection(post_norm, "post norm has no trainable scale: not output-controllable")
        after = [n for n in tail if view.index[n] > view.index[view.by_name[scale.node]]]
    else:
        after = tail
    for n in after:
        if n.target in VIEW_LIKE:
            continue
        factor = _constant_factor(n)
        if factor is None:
            return Rejection(where, f"outer function has op {op_name(n)} after the norm")
        gain *= factor
    if not math.isfinite(gain) or gain == 0.0:
        return Rejection(where, f"branch is multiplied by {gain}: not output-controllable")
    return post_norm, scale, gain


def _constant_factor(node: fx.Node) -> float | None:
    if node.target == aten.mul.Tensor:
        consts = [a for a in node.args if isinstance(a, int | float)]
        if len(consts) == 1:
            return float(consts[0])
    if node.target == aten.div.Tensor and isinstance(node.args[1], int | float):
        return 1.0 / float(node.args[1]) if node.args[1] else None
    return None


def _find_scale(view: GraphView, tail: list[fx.Node], norm: fx.Node) -> ScaleSite | None:
    """The product of a normalised activation and an affine function of one parameter."""
    for n in tail:
        if n.target != aten.mul.Tensor or view.index[n] <= view.index[norm]:
            continue
        args = [a for a in n.args if isinstance(a, fx.Node)]
        if len(args) != 2:
            continue
        acts = [a for a in args if a in view.input_dependent]
        weights = [a for a in args if a not in view.input_dependent]
        if len(acts) != 1 or len(weights) != 1:
            continue
        affine = _affine_of_param(view, weights[0])
        if affine is None:
            continue
        param, alpha, offset = affine
        return ScaleSite(
            node=n.name,
            normalized=acts[0].name,
            param=view.param_name(param),
            alpha=alpha,
            offset=offset,
            module=view.module_path(n),
        )
    return None


def _affine_of_param(view: GraphView, node: fx.Node) -> tuple[fx.Node, float, float] | None:
    """``(w, alpha, offset)`` when ``node = alpha * w + offset`` for a parameter ``w``."""
    alpha, offset = 1.0, 0.0
    while True:
        if view.is_param(node):
            return node, alpha, offset
        if node.op != "call_function":
            return None
        if node.target in VIEW_LIKE:
            node = node.args[0]
            continue
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        consts = [a for a in node.args if isinstance(a, int | float)]
        if len(tensors) != 1 or len(consts) != 1:
            return None
        c = float(consts[0])
        if node.target == aten.add.Tensor:
            offset += alpha * c  # s = alpha * (w' + c) + offset, w' further down
        elif node.target == aten.mul.Tensor and c != 0.0:
            alpha *= c
        else:
            return None
        node = tensors[0]


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


def _common_module(paths) -> str:
    """The longest common dotted prefix of the parents of ``paths``."""
    parents = [p.rsplit(".", 1)[0] if "." in p else p for p in paths]
    if not parents:
        return ""
    split = [p.split(".") for p in parents]
    common = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)
