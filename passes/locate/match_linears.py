"""Analysis: the linear maps of a traced graph, one matcher per way a model writes one.

A linear map multiplies an activation by a parameter matrix. Models write it as
``aten.linear`` (``nn.Linear``), as ``addmm(bias, x, W)`` with the weight stored [in, out]
(GPT-2's Conv1D), as ``x @ W.T`` followed by a separate bias add (Falcon's ``FalconLinear``),
or as a stacked expert bank ``bmm(W[ids], x[..., None])`` (MoE experts with ``batched_mm``), or
as one ``linear`` per slice of a bank over the chunks of a split (JetMoE's parallel experts).
Each matcher recognises one of these at the node that does the product and returns a
:class:`LinearSite`, or None when the node is not of its kind (no match is not a failure).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx

from ctxc.passes.locate.block_map import LinearSite
from ctxc.passes.locate.graph_view import TRANSPOSES, VIEW_LIKE, GraphView, arg_node, op_name

__all__ = [
    "ADDS",
    "LINEAR_MATCHERS",
    "LinearMatcher",
    "find_linear_sites",
    "match_conv1d",
    "match_expert_bank",
    "match_linear",
    "match_split_bank",
    "match_transposed_matmul",
    "routing_nodes",
]

aten = torch.ops.aten

ADDS = frozenset({aten.add.Tensor, aten.add_.Tensor})

LinearMatcher = Callable[[GraphView, fx.Node], "LinearSite | None"]


def find_linear_sites(view: GraphView) -> dict[fx.Node, LinearSite]:
    """Every linear map of the graph, keyed by its output node, in graph order.

    Args:
        view: the graph.

    Returns:
        output node (after a separate bias add or the bank's squeeze) -> its site.
    """
    sites: dict[fx.Node, LinearSite] = {}
    for node in view.nodes:
        if node.op != "call_function" or node not in view.input_dependent:
            continue
        for matcher in LINEAR_MATCHERS:
            site = matcher(view, node)
            if site is not None:
                sites[view.by_name[site.node]] = site
                break
    return sites


def match_linear(view: GraphView, node: fx.Node) -> LinearSite | None:
    """``aten.linear(x, W[out, in], b)``: ``nn.Linear``.

    Args:
        view: the graph.
        node: the candidate product node.

    Returns:
        its site, or None when ``node`` is not a linear of a parameter.
    """
    if node.target != aten.linear.default:
        return None
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    weight = view.param_root(w) if isinstance(w, fx.Node) else None
    bias = view.param_root(b) if isinstance(b, fx.Node) else None
    return _site(view, node, node, x, weight, bias, "out_in")


def match_conv1d(view: GraphView, node: fx.Node) -> LinearSite | None:
    """``addmm(b, x, W)``: GPT-2's Conv1D stores ``W`` as [in, out] (or ``W.T`` as [out, in]).

    Args:
        view: the graph.
        node: the candidate product node.

    Returns:
        its site, or None when ``node`` is not an ``addmm`` by a parameter matrix.
    """
    if node.target != aten.addmm.default:
        return None
    b, x, w = node.args[0], node.args[1], node.args[2]
    bias = view.param_root(b) if isinstance(b, fx.Node) else None
    return _matrix_product(view, node, x, w, bias)


def match_transposed_matmul(view: GraphView, node: fx.Node) -> LinearSite | None:
    """``x @ W.T`` by ``matmul`` or ``mm``, then ``+ b`` as its own op (Falcon's linear).

    Args:
        view: the graph.
        node: the candidate product node.

    Returns:
        its site (ending at the bias add when there is one), or None.
    """
    if node.target not in (aten.matmul.default, aten.mm.default):
        return None
    return _matrix_product(view, node, node.args[0], node.args[1], None)


def match_expert_bank(view: GraphView, node: fx.Node) -> LinearSite | None:
    """``bmm(W[ids], x[..., None]).squeeze(-1)`` (or its transpose): a stacked expert bank.

    Args:
        view: the graph.
        node: the candidate ``bmm``.

    Returns:
        its site (ending at the squeeze, ``experts`` the ids that pick each row's expert), or
        None when ``node`` does not multiply rows by gathered slices of a 3-D parameter.
    """
    if node.target != aten.bmm.default:
        return None
    a, b = node.args[0], node.args[1]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None
    if (gathered := view.param_gather(a)) is not None:
        layout, unsq = "out_in", b  # [S, out, in] @ [S, in, 1]
    elif (gathered := view.param_gather(b)) is not None:
        layout, unsq = "in_out", a  # [S, 1, in] @ [S, in, out]
    else:
        return None
    param, ids = gathered
    if unsq.op != "call_function" or unsq.target != aten.unsqueeze.default:
        return None
    users = view.tensor_users(node)
    if len(users) != 1 or users[0].target not in (aten.squeeze.dim, aten.squeeze.dims):
        return None
    x = unsq.args[0]
    if len(view.shape(param) or ()) != 3 or not isinstance(x, fx.Node):
        return None
    repeat = 1
    if x.op == "call_function" and x.target == aten.repeat_interleave.self_int:
        repeat = int(x.args[1]) if isinstance(x.args[1], int) else 1  # the top-k
        source = view.row_source(arg_node(x))
    else:
        source = view.row_source(x)
    return LinearSite(
        node=users[0].name,
        input=x.name,
        weight=view.param_name(param),
        bias=None,
        module=view.module_path(node),
        layout=layout,
        op=op_name(node),
        experts=ids.name,
        repeat=repeat,
        source=source.name,
    )


def match_split_bank(view: GraphView, node: fx.Node) -> LinearSite | None:
    """``cat([linear(chunk_i, select(W, 0, i)) for i])``, ``chunk_i`` the i-th of
    ``split_with_sizes(x, sizes)``: expert ``i`` of a bank ``W`` [E, out, in] maps the rows
    routed to it (JetMoE's ``JetMoeParallelExperts``; the sizes are the router's counts).

    Args:
        view: the graph.
        node: the candidate ``cat``.

    Returns:
        its site (``experts`` the split, whose chunk lengths give each row's expert; ``tokens``
        the index when ``x = z[tokens]`` gathers token rows), or None when the cat is not one
        linear per bank slice over the split's chunks in order.
    """
    if node.target != aten.cat.default or node.args[1:] not in ((), (0,)):
        return None
    parts = node.args[0]
    found = [_slice_linear(view, p) for p in parts] if isinstance(parts, list | tuple) else []
    if not found or any(f is None for f in found):
        return None
    split, param = found[0][0], found[0][1]  # type: ignore[index]
    chunks = split.meta.get("val")
    experts = (view.shape(param) or (None,))[0]
    in_order = all(f == (split, param, i) for i, f in enumerate(found))
    if not in_order or experts != len(found) or len(chunks or ()) != experts:
        return None
    x = split.args[0]
    if not isinstance(x, fx.Node) or x not in view.input_dependent:
        return None
    tokens = _token_gather(view, x)
    return LinearSite(
        node=node.name,
        input=x.name,
        weight=view.param_name(param),
        bias=None,
        module=view.module_path(split),
        layout="out_in",
        op="aten.linear",
        experts=split.name,
        source=view.row_source(arg_node(x) if tokens else x).name,
        tokens=tokens.name if tokens else None,
    )


def routing_nodes(view: GraphView, site: LinearSite) -> list[fx.Node]:
    """The nodes whose values choose a bank's rows: its ids (or its split's sizes) and tokens.

    Args:
        view: the graph.
        site: an expert bank's site (``site.experts`` set).

    Returns:
        the nodes, for walks up to the router: never the bank's own input rows.
    """
    assert site.experts is not None
    ids = view.by_name[site.experts]
    if ids.target == aten.split_with_sizes.default:
        sizes = ids.args[1] if isinstance(ids.args[1], list | tuple) else ()
        found = [s for s in sizes if isinstance(s, fx.Node)]
    else:
        found = [ids]
    return found + ([view.by_name[site.tokens]] if site.tokens else [])


LINEAR_MATCHERS: tuple[LinearMatcher, ...] = (
    match_linear,
    match_conv1d,
    match_transposed_matmul,
    match_expert_bank,
    match_split_bank,
)


def _slice_linear(view: GraphView, node: object) -> tuple[fx.Node, fx.Node, int] | None:
    """``(split, W, i)`` when ``node = linear(split[i], select(W, 0, i))``, no bias, W 3-D."""
    if not isinstance(node, fx.Node) or node.target != aten.linear.default:
        return None
    if len(node.args) > 2 and node.args[2] is not None:
        return None
    x, w = node.args[0], node.args[1]
    if not (isinstance(x, fx.Node) and isinstance(w, fx.Node)):
        return None
    if x.target is not operator.getitem or w.target != aten.select.int:
        return None
    split, i = x.args
    param = view.param_root(w.args[0]) if isinstance(w.args[0], fx.Node) else None
    if param is None or not isinstance(split, fx.Node) or not isinstance(i, int):
        return None
    if w.args[1:] != (0, i):
        return None
    if split.target != aten.split_with_sizes.default or split.args[2:] not in ((), (0,)):
        return None
    return split, param, i


def _token_gather(view: GraphView, x: fx.Node) -> fx.Node | None:
    """The index ``t`` when ``x = rows[t]`` gathers whole rows of an activation by a 1-D index."""
    if x.target != aten.index.Tensor:
        return None
    base, index = x.args[0], x.args[1]
    if not isinstance(base, fx.Node) or not view.is_float_activation(base):
        return None
    if not isinstance(index, list | tuple) or len(index) != 1:
        return None
    t = index[0]
    if not isinstance(t, fx.Node):
        return None
    ok = len(view.shape(t) or ()) == 1 and len(view.shape(base) or ()) == 2
    return t if ok else None


def _matrix_product(
    view: GraphView, node: fx.Node, x: object, w: object, bias: fx.Node | None
) -> LinearSite | None:
    """A 2-D product by a parameter matrix, with a bias add after it when ``bias`` is None."""
    if not isinstance(w, fx.Node) or (found := _param_matrix(view, w)) is None:
        return None
    weight, transposed = found
    out = node
    users = view.tensor_users(node)
    if bias is None and len(users) == 1 and users[0].target in ADDS:
        other = [a for a in users[0].args if isinstance(a, fx.Node) and a is not node]
        root = view.param_root(other[0]) if len(other) == 1 else None
        if root is not None and len(view.shape(root) or ()) == 1:
            bias, out = root, users[0]
    return _site(view, node, out, x, weight, bias, "out_in" if transposed else "in_out")


def _site(
    view: GraphView,
    node: fx.Node,
    out: fx.Node,
    x: object,
    weight: fx.Node | None,
    bias: fx.Node | None,
    layout: str,
) -> LinearSite | None:
    """The site of a product ``node`` whose value (after its bias) is ``out``."""
    if weight is None or not isinstance(x, fx.Node) or x not in view.input_dependent:
        return None
    return LinearSite(
        node=out.name,
        input=x.name,
        weight=view.param_name(weight),
        bias=view.param_name(bias) if bias is not None else None,
        module=view.module_path(node),
        layout=layout,
        op=op_name(node),
        source=view.row_source(x).name,
    )


def _param_matrix(view: GraphView, node: fx.Node) -> tuple[fx.Node, bool] | None:
    """``(param, transposed)`` when ``node`` is a 2-D parameter, possibly cast or transposed."""
    transposed = False
    while node.op == "call_function":
        if node.target in VIEW_LIKE:
            pass  # the value itself, cast or copied
        elif node.target in TRANSPOSES or (
            node.target == aten.permute.default
            and isinstance(dims := node.args[1], list | tuple)
            and list(dims) in ([1, 0], [-1, -2])
        ):
            transposed = not transposed
        else:
            break
        arg = node.args[0]
        if not isinstance(arg, fx.Node):
            return None
        node = arg
    val = node.meta.get("val")
    if view.is_param(node) and isinstance(val, torch.Tensor) and val.dim() == 2:
        return node, transposed
    return None
