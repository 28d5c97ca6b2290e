"""Analysis: normalisations in a traced graph, fused (``aten.layer_norm``) or written out.

The locator meets norms in three places: after the outer linear (a post norm, whose trainable
scale or bias may be the output control), before the MLP (the pre norm that makes ``z``), and
on the residual sum itself (classic post-LN). Each recogniser returns what it finds, or None
when the ops are not a norm of its kind (no match is not a failure).
"""

from __future__ import annotations

import torch
from torch import fx

from ctxc.passes.locate.block_map import NormSite, ScaleSite
from ctxc.passes.locate.graph_view import VIEW_LIKE, GraphView, arg_node, op_name

__all__ = [
    "FUSED_NORMS",
    "fused_norm",
    "is_norm_output",
    "scale_site",
    "trailing_norm",
    "written_norm",
]

aten = torch.ops.aten

FUSED_NORMS = frozenset({aten.layer_norm.default, aten.rms_norm.default})
# Ops a norm written out op by op uses between its input and the normalised value.
_NORM_OPS = frozenset(
    {
        aten.pow.Tensor_Scalar,
        aten.mean.dim,
        aten.rsqrt.default,
        aten.sqrt.default,
        aten.mul.Tensor,
        aten.div.Tensor,
        aten.add.Tensor,
        aten.sub.Tensor,
        aten.square.default,
        aten.reciprocal.default,
        aten.var.correction,
    }
    | VIEW_LIKE
)
_ROOTS = frozenset({aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default})
_NORM_WINDOW = 40  # nodes: a written-out norm closes within this many ops of its input


def written_norm(view: GraphView, start: fx.Node) -> tuple[NormSite, fx.Node] | None:
    """A norm written out op by op from ``start``.

    The normalised value is where every path from ``start`` meets again (``x * rsqrt(...)``):
    the first node after which no op of the region has a user outside it.

    Args:
        view: the graph.
        start: the node the norm would read.

    Returns:
        ``(site, normalised node)``, or None when the ops after ``start`` are not a norm.
    """
    region: list[fx.Node] = []
    inside = {start}
    first = view.index[start] + 1
    for n in view.nodes[first : first + _NORM_WINDOW]:
        if not any(a in inside for a in view.value_args(n)):
            continue
        region.append(n)
        inside.add(n)
        done = all(set(view.tensor_users(m)) <= inside for m in [start, *region[:-1]])
        if done:
            break
    else:
        return None
    ops = {m.target for m in region}
    # pow(., -0.5) is rsqrt written as a power (Gemma 3n / Gemma 4 post norms).
    roots = ops & _ROOTS or any(
        m.target == aten.pow.Tensor_Scalar and m.args[1] in (-0.5, 0.5) for m in region
    )
    if not ops <= _NORM_OPS or aten.mean.dim not in ops or not roots:
        return None
    for m in region:  # a weight inside the region (w * x * rsqrt): not a plain normalisation
        if any(a not in view.input_dependent for a in view.value_args(m)):
            return None
    p = region[-1]
    centered = aten.sub.Tensor in ops
    site = NormSite(
        module=view.module_path(p), input=start.name, centered=centered, eps=_eps(region)
    )
    return site, p


def _eps(region: list[fx.Node]) -> float | None:
    """The constant a written norm adds under its root (``mean(x^2) + eps``), when one is."""
    found = {
        float(a)
        for m in region
        if m.target == aten.add.Tensor
        for a in m.args
        if isinstance(a, int | float) and not isinstance(a, bool)
    }
    return found.pop() if len(found) == 1 else None


def fused_norm(view: GraphView, node: fx.Node) -> NormSite:
    """The site of ``aten.layer_norm(x, shape, w, b, eps)`` or ``aten.rms_norm(x, shape, w, eps)``.

    Args:
        view: the graph.
        node: a node whose target is in :data:`FUSED_NORMS`.

    Returns:
        the norm, with its scale and bias when it has them.
    """
    layer = node.target == aten.layer_norm.default
    args = list(node.args)
    w = args[2] if len(args) > 2 else None
    b = args[3] if layer and len(args) > 3 else None
    eps = args[4] if layer and len(args) > 4 else (args[3] if not layer and len(args) > 3 else None)
    weight = view.param_root(w) if isinstance(w, fx.Node) else None
    bias = view.param_root(b) if isinstance(b, fx.Node) else None
    module = view.module_path(node)
    scale = None
    if weight is not None:
        scale = ScaleSite(node.name, "", view.param_name(weight), 1.0, 0.0, module)
    return NormSite(
        module=module,
        input=arg_node(node).name,
        centered=layer,
        fused=op_name(node),
        eps=float(eps) if isinstance(eps, int | float) else 1e-5,
        scale=scale,
        bias=view.param_name(bias) if bias is not None else None,
        bias_node=node.name if bias is not None else None,
    )


def scale_site(view: GraphView, mul: fx.Node, normalized: fx.Node) -> ScaleSite | None:
    """The trainable scale of ``mul = normalized * (alpha * w + offset)``.

    Args:
        view: the graph.
        mul: the product.
        normalized: the normalised operand.

    Returns:
        the scale, or None when the other operand is not an affine function of one parameter.
    """
    weights = [a for a in mul.args if isinstance(a, fx.Node) and a is not normalized]
    if len(weights) != 1:
        return None
    affine = _affine_of_param(view, weights[0])
    if affine is None:
        return None
    param, alpha, offset = affine
    return ScaleSite(
        node=mul.name,
        normalized=normalized.name,
        param=view.param_name(param),
        alpha=alpha,
        offset=offset,
        module=view.module_path(mul),
    )


def is_norm_output(view: GraphView, node: fx.Node) -> bool:
    """Is ``node`` the output of a norm (fused, or ``x * rsqrt(...)`` and an affine after it)?

    Args:
        view: the graph.
        node: the candidate.

    Returns:
        True when a norm computes it, through casts and a trailing scale and bias.
    """
    for _ in range(8):
        if node.op != "call_function":
            return False
        if node.target in FUSED_NORMS:
            return True
        if node.target in VIEW_LIKE:
            node = arg_node(node)
            continue
        acts = [a for a in view.value_args(node) if a in view.input_dependent]
        if node.target in (aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor) and len(acts) == 2:
            return any(a.op == "call_function" and a.target in _ROOTS for a in acts)
        if node.target in (aten.mul.Tensor, aten.add.Tensor) and len(acts) == 1:
            node = acts[0]  # the affine part: times a scale, plus a bias
            continue
        return False
    return False


def trailing_norm(view: GraphView, y: fx.Node) -> str | None:
    """The norm that reads the residual sum ``y`` alone, inside ``y``'s layer (classic post-LN).

    Args:
        view: the graph.
        y: the block's residual add.

    Returns:
        the norm's module path, or None.
    """
    layer = view.module_path(y)
    node = y
    for _ in range(4):
        users = view.tensor_users(node)
        if len(users) == 1 and (users[0].target in VIEW_LIKE or view.keeps_rows(users[0])):
            node = users[0]
            continue
        if len(users) == 1 and users[0].target in FUSED_NORMS:
            norm = users[0]
        elif len(users) > 1 and (found := written_norm(view, node)) is not None:
            norm = found[1]
        else:
            return None
        module = view.module_path(norm)
        return module if layer and module.startswith(layer + ".") else None
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
            node = arg_node(node)
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
