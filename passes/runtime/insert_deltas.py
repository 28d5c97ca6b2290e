"""Graph transform: bake a :class:`~ctxc.patch.Patch` into an exported graph as in-graph
deltas.

``Patch.apply`` overwrites a model's weights; this pass instead leaves the weights alone and adds
the delta factors to an unlifted ``GraphModule`` (``traced.program.module()``), with nodes that
compute the patched weight from the original one where the graph reads it. The result is one
self-contained module that computes the patched model (the ONNX backend exports it) while its
base weights stay shared with the model and untouched.

The inserted nodes compute exactly :meth:`Delta.materialize`, op for op::

    (W.to(float32) + mm(u, t(v)) [then t(), for layout "in_out"]).to(W.dtype)
    (W.to(float32) + vector).to(W.dtype)
    w = W.to(float32); w[idx] = w[idx] + bmm(u, v.mT) [.mT for "in_out"]; w.to(W.dtype)

(the last for a stacked MoE expert bank ``[E, out, in]``, ``idx`` the experts the delta changes),
so the patched graph's outputs are bit for bit those of the model with ``patch.apply``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import fx

from ctxc.core.errors import CtxcError
from ctxc.frontend.trace import WRAPPED
from ctxc.patch import Delta, Patch

__all__ = ["DELTA_PREFIX", "InsertResult", "ParamOf", "delta_attr_name", "insert_deltas"]

aten = torch.ops.aten

# Attributes this pass registers on the GraphModule start with it, so they are easy to find
# (and a second insertion of the same patch is caught instead of stacking the deltas).
DELTA_PREFIX = "ctxc_delta_"

# How a ``get_attr`` node maps to a patch parameter name: a function of the node (None for a node
# that holds no patchable parameter), or a table keyed by the node's target (its attribute path).
ParamOf = Callable[[fx.Node], str | None] | Mapping[str, str]


@dataclass(frozen=True)
class InsertResult:
    """What :func:`insert_deltas` did.

    Attributes:
        gm: the GraphModule, mutated in place (the same object that was passed in).
        inserted: names of the patched parameters, in the patch's order.
        nodes_added: number of graph nodes added (``get_attr`` nodes of the factors included).
        replaced: number of original parameters whose readers now read the patched value (one
            per delta).
        attrs_added: the attributes registered on ``gm``: the factors (``u``, ``v``, ``vector``)
            as frozen parameters, an expert bank's indices (``experts``) as a buffer.
    """

    gm: fx.GraphModule
    inserted: tuple[str, ...]
    nodes_added: int
    replaced: int = 0
    attrs_added: tuple[str, ...] = ()


def delta_attr_name(param: str, part: str) -> str:
    """The GraphModule attribute holding one factor of ``param``'s delta.

    Args:
        param: parameter name (``model.layers.0.mlp.up_proj.weight``).
        part: ``"u"``, ``"v"``, ``"vector"``, or ``"experts"`` (an expert bank's indices).

    Returns:
        e.g. ``ctxc_delta_model_layers_0_mlp_up_proj_weight_u`` (a plain identifier, so it is an
        attribute of the root module rather than a path into a submodule).
    """
    return f"{_node_base(param)}_{part}"


def _node_base(param: str) -> str:
    # Every non-identifier character becomes "_", so the name is valid Python in gm.code.
    return DELTA_PREFIX + re.sub(r"\W", "_", param)


def insert_deltas(
    gm: fx.GraphModule, patch: Patch, param_of_node: ParamOf | None = None
) -> InsertResult:
    """Add ``patch``'s deltas to ``gm`` so that it computes the patched model.

    This MUTATES ``gm`` and returns it inside the result: for each patched parameter it
    registers the delta's factors (``u``, ``v``) or vector as new frozen parameters named by
    :func:`delta_attr_name` (and an expert bank's indices as a buffer), inserts nodes computing
    :meth:`Delta.materialize` from the original weight just before the graph first reads it, and
    makes every reader of the weight read the patched value instead. The original weights (the
    model's own tensors) are not modified. The graph is linted and the module recompiled.

    Args:
        gm: an unlifted GraphModule, ``traced.program.module()``: parameters are ``get_attr``
            nodes whose target is the attribute path (``model.model.layers.0.mlp.up_proj.weight``).
        patch: the patch to insert; each of its parameters must be read by some ``get_attr``.
        param_of_node: maps a ``get_attr`` node to a patch parameter name: a callable
            ``node -> name | None``, or a dict ``target -> name``. Default: the target without the
            export wrapper's ``model.`` prefix, which gives ``model.state_dict()`` names.

    Returns:
        an :class:`InsertResult`: ``gm`` itself, the patched parameter names, the counts of
        nodes added and parameters replaced, the attributes registered.

    Raises:
        CtxcError: a patched parameter is not in the graph, a delta's shape does not match its
            parameter, or ``gm`` already holds a delta for it. Raised before ``gm`` is changed.
    """
    name_of = _resolver(param_of_node)
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}

    sources: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            name = name_of(node)
            if name is not None and name in patch.deltas:
                sources.setdefault(name, []).append(node)
    # Check everything first, so a bad patch leaves gm as it was rather than half patched.
    missing = [name for name in patch.deltas if name not in sources]
    if missing:
        raise CtxcError(
            f"{len(missing)} patched parameter(s) are not read by this graph: "
            + ", ".join(missing[:5])
            + (" ..." if len(missing) > 5 else "")
        )
    weights = {name: _fetch(gm, str(nodes[0].target)) for name, nodes in sources.items()}
    taken: set[str] = set()
    for name, delta in patch.deltas.items():
        _check(name, delta, weights[name], gm, taken)

    added = 0
    replaced = 0
    attrs_before = set(dict(gm.named_parameters())) | set(dict(gm.named_buffers()))
    for name, delta in patch.deltas.items():
        nodes = sources[name]
        users = [user for node in nodes for user in node.users]
        # Insert just before the first reader, so the graph keeps its inputs-then-body order;
        # a weight nobody reads (dead after export) gets its nodes right after its get_attr.
        anchor = min(users, key=order.__getitem__) if users else nodes[-1].next
        with graph.inserting_before(anchor):
            new = _emit(gm, name, delta, nodes[0], weights[name])
        patched = new[-1]
        for user in users:
            # Only the old readers move: the new nodes themselves must still read the original.
            for node in nodes:
                user.replace_input_with(node, patched)
        added += len(new)
        replaced += bool(users)

    graph.lint()
    gm.recompile()
    attrs = set(dict(gm.named_parameters())) | set(dict(gm.named_buffers()))
    return InsertResult(
        gm=gm,
        inserted=tuple(patch.deltas),
        nodes_added=added,
        replaced=replaced,
        attrs_added=tuple(sorted(attrs - attrs_before)),
    )


def _resolver(param_of_node: ParamOf | None) -> Callable[[fx.Node], str | None]:
    if param_of_node is None:
        return _strip_wrapper
    if isinstance(param_of_node, Mapping):
        table = param_of_node
        return lambda node: table.get(str(node.target))
    return param_of_node


def _strip_wrapper(node: fx.Node) -> str | None:
    # trace() exports a wrapper holding the model as `model`: strip it to get state_dict names.
    target = str(node.target)
    prefix = WRAPPED + "."
    return target[len(prefix) :] if target.startswith(prefix) else target


def _fetch(gm: fx.GraphModule, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, torch.Tensor):
        raise CtxcError(f"graph attribute {target} is not a tensor")
    return obj


def _parts(delta: Delta) -> dict[str, torch.Tensor]:
    # The same precedence as Delta.dense: a vector wins over factors.
    if delta.vector is not None:
        return {"vector": delta.vector}
    if delta.u is None or delta.v is None:
        raise CtxcError(f"delta of {delta.param} has neither factors nor a vector")
    return {"u": delta.u, "v": delta.v}


def _check(
    name: str, delta: Delta, weight: torch.Tensor, gm: fx.GraphModule, taken: set[str]
) -> None:
    parts = _parts(delta)
    if "vector" in parts:
        shape = tuple(parts["vector"].shape)
    else:
        shape = _factor_shape(name, delta, parts["u"], parts["v"], weight)
    # An exact check: a mismatched vector would otherwise broadcast silently.
    if shape != tuple(weight.shape):
        raise CtxcError(f"delta of {name} has shape {shape}, its parameter {tuple(weight.shape)}")
    for part in [*parts, *(["experts"] if delta.experts else [])]:
        attr = delta_attr_name(name, part)
        if hasattr(gm, attr):
            raise CtxcError(
                f"the graph module already has {attr}: a patch was inserted into it already"
            )
        # Two names that sanitise alike ("a.b", "a_b") would silently share one attribute.
        if attr in taken:
            raise CtxcError(f"two patched parameters map to the same attribute {attr}")
        taken.add(attr)


def _factor_shape(
    name: str, delta: Delta, u: torch.Tensor, v: torch.Tensor, weight: torch.Tensor
) -> tuple[int, ...]:
    """The parameter shape ``u @ v.T`` (per expert, for a bank) implies, in its layout."""
    bank = bool(delta.experts)
    want = 3 if bank else 2
    if u.dim() != want or v.dim() != want or u.shape[-1] != v.shape[-1]:
        what = "[n, out, r] and [n, in, r]" if bank else "[out, r] and [in, r]"
        raise CtxcError(
            f"delta of {name}: factors u {tuple(u.shape)} and v {tuple(v.shape)} are not {what}"
        )
    out, inp = int(u.shape[-2]), int(v.shape[-2])
    shape = (inp, out) if delta.layout == "in_out" else (out, inp)
    if not bank:
        return shape
    n, size = len(delta.experts), int(weight.shape[0]) if weight.dim() == 3 else 0
    if u.shape[0] != n or v.shape[0] != n or not all(0 <= e < size for e in delta.experts):
        raise CtxcError(
            f"delta of {name}: experts {list(delta.experts)} do not fit factors of {u.shape[0]} "
            f"experts and a bank of {size}"
        )
    return (size, *shape)


def _emit(
    gm: fx.GraphModule, name: str, delta: Delta, source: fx.Node, weight: torch.Tensor
) -> list[fx.Node]:
    """Nodes computing ``delta.materialize(weight)``, at the graph's insert point, in order."""
    graph = gm.graph
    base = _node_base(name)
    # Give the new nodes fake values like the exporter's own, for passes that read shapes.
    fake_mode = getattr(source.meta.get("val"), "fake_mode", None)
    new: list[fx.Node] = []

    def attr(part: str, value: torch.Tensor) -> fx.Node:
        target = delta_attr_name(name, part)
        # A copy on the weight's device: the module owns its deltas, later edits of the patch
        # do not leak in, and the to(copy=True) keeps strides, so products match bit for bit.
        tensor = value.detach().to(device=weight.device, copy=True)
        if tensor.is_floating_point():
            gm.register_parameter(target, torch.nn.Parameter(tensor, requires_grad=False))
        else:
            gm.register_buffer(target, tensor)
        node = graph.get_attr(target)
        if fake_mode is not None:
            node.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True)
        new.append(node)
        return node

    def call(op, args: tuple, suffix: str) -> fx.Node:
        node = graph.create_node("call_function", op, args, name=f"{base}_{suffix}")
        if fake_mode is not None:
            with fake_mode:
                node.meta["val"] = op(*fx.node.map_arg(args, lambda a: a.meta["val"]))
        new.append(node)
        return node

    # Mirror compiler/core/delta_math.py (what Delta.materialize calls) as graph nodes: the same ops
    # on the same tensors give the same bits, so this graph is interchangeable with patch.apply.
    parts = _parts(delta)
    w32 = call(aten.to.dtype, (source, torch.float32), "w32")
    if "vector" in parts:
        dense = attr("vector", parts["vector"])
    elif delta.experts:
        u, v = attr("u", parts["u"]), attr("v", parts["v"])
        vt = call(aten.transpose.int, (v, -2, -1), "vt")
        dense = call(aten.bmm.default, (u, vt), "dw")  # [n, out, in]: u @ v.mT
        if delta.layout == "in_out":
            dense = call(aten.transpose.int, (dense, -2, -1), "dwt")
    else:
        u, v = attr("u", parts["u"]), attr("v", parts["v"])
        vt = call(aten.t.default, (v,), "vt")
        dense = call(aten.mm.default, (u, vt), "dw")  # [out, in]
        if delta.layout == "in_out":
            dense = call(aten.t.default, (dense,), "dwt")
    if delta.experts:
        # w[idx] = w[idx] + dense, functionally: the listed experts change, the others keep
        # their bits (adding zeros instead would turn a -0.0 weight into +0.0).
        idx = attr("experts", torch.tensor(delta.experts, dtype=torch.long))
        picked = call(aten.index.Tensor, (w32, [idx]), "picked")
        summed = call(aten.add.Tensor, (picked, dense), "sum")
        summed = call(aten.index_put.default, (w32, [idx], summed), "put")
    else:
        summed = call(aten.add.Tensor, (w32, dense), "sum")
    call(aten.to.dtype, (summed, weight.dtype), "patched")
    return new
