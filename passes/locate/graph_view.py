"""A read-only view of an exported graph: data flow, parameters, ops and module paths.

The analyses in this package ask the same questions of the graph again and again (is this node
a parameter, what does it read through casts, which nodes lie between two others); this class
answers them once, from the graph and its ``graph_signature``, never from node names.
"""

from __future__ import annotations

import math
import weakref
from functools import cached_property
from typing import TYPE_CHECKING, TypeGuard

import sympy
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ctxc.frontend.trace import WRAPPED, TracedModel

if TYPE_CHECKING:  # networkx is imported when a graph is analysed: a cached export needs none
    import networkx as nx

__all__ = [
    "ELEMENTWISE",
    "ROW_VIEWS",
    "TRANSPOSES",
    "VIEW_LIKE",
    "GraphView",
    "arg_node",
    "op_name",
]

aten = torch.ops.aten

# Ops that carry a tensor through unchanged in value (up to dtype): the locator sees through them.
VIEW_LIKE = frozenset(
    {
        aten.to.dtype,
        aten.to.dtype_layout,
        aten.to.device,
        aten._to_copy.default,
        aten.type_as.default,
        aten.clone.default,
        aten.contiguous.default,
        aten.alias.default,
        aten.dropout.default,
        aten.detach.default,
        aten.lift_fresh_copy.default,
    }
)

# Position-wise unary or scalar-binary ops allowed between the LM head and the graph output.
ELEMENTWISE = frozenset(
    {
        aten.div.Tensor,
        aten.mul.Tensor,
        aten.tanh.default,
        aten.add.Tensor,
        aten.sub.Tensor,
    }
    | VIEW_LIKE
)

# Reshapes that may keep every row (position) intact: the locator sees through those that keep
# the last dimension and the number of rows (GPT-2's Conv1D flattens [1, seq, d] to [seq, d]).
ROW_VIEWS = frozenset(
    {
        aten.view.default,
        aten.reshape.default,
        aten._unsafe_view.default,
        aten.unsqueeze.default,
        aten.squeeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.flatten.using_ints,
    }
)

# Ops that transpose a weight matrix (Falcon's ``x @ W.T``; nn.Linear lowered to ``addmm``).
TRANSPOSES = frozenset({aten.t.default, aten.numpy_T.default, aten.transpose.int})

ATTENTION_OPS = frozenset(
    {
        aten.scaled_dot_product_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
    }
)
_PRODUCTS = frozenset(
    {aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.mm.default}
)


_VIEWS: weakref.WeakKeyDictionary[fx.GraphModule, GraphView] = weakref.WeakKeyDictionary()


def op_name(node: fx.Node) -> str:
    """A stable name for a node's operation: ``aten.linear`` for ``aten.linear.default``."""
    if node.op != "call_function":
        return node.op
    name = str(node.target)
    return name[: -len(".default")] if name.endswith(".default") else name


def arg_node(node: fx.Node, i: int = 0) -> fx.Node:
    """``node.args[i]`` where the op takes a tensor there (a view's, cast's or norm's input).

    fx types an argument as any value one can hold; at these positions the matched ops read a
    tensor, so anything else is a matcher bug, raised as such, not a graph to reject.

    Raises:
        TypeError: the argument is not a node.
    """
    arg = node.args[i]
    if not isinstance(arg, fx.Node):
        raise TypeError(f"{node.name}: argument {i} of {op_name(node)} is not a node: {arg!r}")
    return arg


class GraphView:
    """Cached structural queries over a :class:`TracedModel`'s graph (pure, no mutation)."""

    @classmethod
    def of(cls, traced: TracedModel) -> GraphView:
        """The view of ``traced``'s graph, made once per exported graph (``ctxc generate``
        solves at every token and asks the same questions each time)."""
        view = _VIEWS.get(traced.graph_module)
        if view is None:
            view = _VIEWS[traced.graph_module] = cls(traced)
        return view

    def __init__(self, traced: TracedModel) -> None:
        self.traced = traced
        self.graph = traced.graph
        self.nodes: list[fx.Node] = list(self.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.by_name = {n.name: n for n in self.nodes}
        self.param_of = traced.param_of

    @cached_property
    def param_node(self) -> dict[str, fx.Node]:
        """Parameter name -> its placeholder node (from ``graph_signature``)."""
        return {name: self.by_name[node] for node, name in self.param_of.items()}

    @cached_property
    def dag(self) -> nx.DiGraph:
        import networkx as nx

        g = nx.DiGraph()
        g.add_nodes_from(self.nodes)
        for n in self.nodes:
            for user in n.users:
                g.add_edge(n, user)
        return g

    @cached_property
    def input_dependent(self) -> frozenset[fx.Node]:
        """Nodes whose value depends on ``input_ids`` (activations, not weights)."""
        source = self.by_name[self.traced.input_name]
        return frozenset(self.descendants(source) | {source})

    def ancestors(self, node: fx.Node) -> set[fx.Node]:
        from networkx import ancestors

        return ancestors(self.dag, node)

    def descendants(self, node: fx.Node) -> set[fx.Node]:
        from networkx import descendants

        return descendants(self.dag, node)

    def descendants_upto(self, node: fx.Node, last: int) -> list[fx.Node]:
        """Descendants of ``node`` whose graph index is at most ``last``, in graph order."""
        seen: set[fx.Node] = set()
        stack = [node]
        while stack:
            for user in stack.pop().users:
                if user not in seen and self.index[user] <= last:
                    seen.add(user)
                    stack.append(user)
        return sorted(seen, key=self.index.__getitem__)

    def between(self, start: fx.Node, end: fx.Node) -> set[fx.Node]:
        """Nodes on some path from ``start`` to ``end``, both excluded."""
        return self.descendants(start) & self.ancestors(end)

    def is_param(self, node: fx.Node) -> bool:
        return node.op == "placeholder" and node.name in self.param_of

    def param_name(self, node: fx.Node) -> str:
        return self.param_of[node.name]

    def see_through(self, node: fx.Node) -> fx.Node:
        """The node whose value ``node`` carries through casts, copies and dropout."""
        while node.op == "call_function" and node.target in VIEW_LIKE:
            arg = node.args[0]
            if not isinstance(arg, fx.Node):
                break
            node = arg
        return node

    def param_root(self, node: fx.Node) -> fx.Node | None:
        """The parameter placeholder that ``node`` is (through casts), else None."""
        root = self.see_through(node)
        return root if self.is_param(root) else None

    def param_only(self, node: fx.Node) -> bool:
        """True when ``node`` does not depend on the input (a weight or a function of weights)."""
        return node not in self.input_dependent

    def module_path(self, node: fx.Node) -> str:
        """The innermost module path of ``node`` (wrapper prefix removed), or ''."""
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            return ""
        path = list(stack.values())[-1][0]
        prefix = WRAPPED + "."
        return path[len(prefix) :] if path.startswith(prefix) else path

    def shape(self, node: fx.Node) -> tuple[int | None, ...] | None:
        """The node's shape from its fake value; symbolic sizes become None."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        return tuple(s if isinstance(s, int) else None for s in val.shape)

    def is_float_activation(self, node: fx.Node) -> bool:
        val = node.meta.get("val")
        return (
            isinstance(val, torch.Tensor)
            and val.is_floating_point()
            and node in self.input_dependent
        )

    def is_token_mixing(self, node: fx.Node) -> bool:
        """Attention ops, or a product of two activations (eager attention's q @ k^T).

        A batched product with a gathered weight (``bmm(W[ids], x)``, MoE experts) is a
        per-row linear map, not a mixer, although ``W[ids]`` depends on the input.
        """
        if node.op != "call_function":
            return False
        if node.target in ATTENTION_OPS:
            return True
        if node.target in _PRODUCTS:
            tensors = [a for a in node.args if isinstance(a, fx.Node)]
            if any(self.param_gather(a) is not None for a in tensors):
                return False
            return sum(a in self.input_dependent for a in tensors) >= 2
        return False

    def param_gather(self, node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
        """``(param, ids)`` when ``node = param[ids]`` gathers slices of a parameter by row ids."""
        if node.op != "call_function" or node.target != aten.index.Tensor:
            return None
        base, index = node.args[0], node.args[1]
        if not isinstance(base, fx.Node) or not isinstance(index, list | tuple):
            return None
        param = self.param_root(base)
        ids = [i for i in index if isinstance(i, fx.Node)]
        if param is None or len(index) != 1 or len(ids) != 1:
            return None
        return param, ids[0]

    def is_tensor(self, node: object) -> TypeGuard[fx.Node]:
        """A node whose value is a tensor, or a tuple of tensors (``topk``, ``chunk``)."""
        if not isinstance(node, fx.Node):
            return False
        val = node.meta.get("val")
        if isinstance(val, list | tuple):
            return bool(val) and all(isinstance(v, torch.Tensor) for v in val)
        return isinstance(val, torch.Tensor)

    def tensor_users(self, node: fx.Node) -> list[fx.Node]:
        """Users that read ``node``'s values: not shape queries, metadata asserts, or
        ``type_as(x, node)``, which reads only its dtype."""
        users = (
            u
            for u in node.users
            if self.is_tensor(u)
            and not (u.target == aten.type_as.default and u.args[0] is not node)
        )
        return sorted(users, key=self.index.__getitem__)

    def value_args(self, node: fx.Node) -> list[fx.Node]:
        """The tensor arguments whose values ``node`` reads (``type_as``'s second is a dtype)."""
        args = node.args[:1] if node.target == aten.type_as.default else node.args
        out: list[fx.Node] = []
        for a in (*args, *node.kwargs.values()):
            items = a if isinstance(a, list | tuple) else (a,)
            out.extend(i for i in items if self.is_tensor(i))
        return out

    def rows(self, node: fx.Node) -> tuple[str, int | None] | None:
        """``(rows, last)``: the symbolic product of all but the last dimension, and the last."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() == 0:
            return None
        count = sympy.Integer(1)
        for size in val.shape[:-1]:
            count = count * (sympy.Integer(size) if isinstance(size, int) else size.node.expr)
        last = val.shape[-1]
        return str(sympy.simplify(count)), last if isinstance(last, int) else None

    def same_rows(self, a: fx.Node, b: fx.Node) -> bool:
        """Whether ``a`` and ``b`` have as many rows, symbolically or by the export's facts.

        Rows counted by sizes read at run time (JetMoE's ``split_with_sizes`` by the router's
        counts: ``u4 + u5 + u6 + u7``) equal the token rows (``2*s70``) only through the
        runtime assertion the export recorded; the shape environment knows it as an axiom.
        """
        ra, rb = self.rows(a), self.rows(b)
        if ra is None or rb is None:
            return False
        if ra[0] == rb[0]:
            return True
        va, vb = a.meta["val"], b.meta["val"]
        try:
            return bool(statically_known_true(math.prod(va.shape[:-1]) == math.prod(vb.shape[:-1])))
        except Exception:  # a stored graph's values carry no shape environment
            return False

    def keeps_rows(self, node: fx.Node) -> bool:
        """A reshape of its first argument that keeps every row: same rows, same last dim."""
        if node.op != "call_function" or node.target not in ROW_VIEWS:
            return False
        src = node.args[0]
        if not isinstance(src, fx.Node):
            return False
        mine, theirs = self.rows(node), self.rows(src)
        return mine is not None and mine == theirs and mine[1] is not None

    def row_source(self, node: fx.Node) -> fx.Node:
        """The node whose rows ``node`` carries, through casts, copies and row-keeping reshapes."""
        while node.op == "call_function" and (node.target in VIEW_LIKE or self.keeps_rows(node)):
            arg = node.args[0]
            if not isinstance(arg, fx.Node):
                break
            node = arg
        return node
