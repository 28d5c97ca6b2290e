"""A read-only view of an exported graph: data flow, parameters, ops and module paths.

The analyses in this package ask the same questions of the graph again and again (is this node
a parameter, what does it read through casts, which nodes lie between two others); this class
answers them once, from the graph and its ``graph_signature``, never from node names.
"""

from __future__ import annotations

from functools import cached_property

import networkx as nx
import torch
from torch import fx

from ctxc.trace import TracedModel

__all__ = ["ELEMENTWISE", "VIEW_LIKE", "GraphView", "op_name"]

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


def op_name(node: fx.Node) -> str:
    """A stable name for a node's operation: ``aten.linear`` for ``aten.linear.default``."""
    if node.op != "call_function":
        return node.op
    name = str(node.target)
    return name[: -len(".default")] if name.endswith(".default") else name


class GraphView:
    """Cached structural queries over a :class:`TracedModel`'s graph (pure, no mutation)."""

    def __init__(self, traced: TracedModel) -> None:
        self.traced = traced
        self.graph = traced.graph
        self.nodes: list[fx.Node] = list(self.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.by_name = {n.name: n for n in self.nodes}
        self.param_of = traced.param_of

    @cached_property
    def dag(self) -> nx.DiGraph:
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
        return frozenset(nx.descendants(self.dag, source) | {source})

    def ancestors(self, node: fx.Node) -> set[fx.Node]:
        return nx.ancestors(self.dag, node)

    def descendants(self, node: fx.Node) -> set[fx.Node]:
        return nx.descendants(self.dag, node)

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
        return _strip_wrapper(path)

    def module_type(self, node: fx.Node) -> str:
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            return ""
        typ = list(stack.values())[-1][1]
        return getattr(typ, "__name__", str(typ).rsplit(".", 1)[-1].strip("'>"))

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
        """Attention ops, or a product of two activations (eager attention's q @ k^T)."""
        if node.op != "call_function":
            return False
        if node.target in ATTENTION_OPS:
            return True
        if node.target in _PRODUCTS:
            tensors = [a for a in node.args if isinstance(a, fx.Node)]
            return sum(a in self.input_dependent for a in tensors) >= 2
        return False


def _strip_wrapper(path: str) -> str:
    from ctxc.trace import _WRAPPED

    prefix = _WRAPPED + "."
    return path[len(prefix) :] if path.startswith(prefix) else path
