"""Analysis: whether an MLP-shaped core is a residual MLP branch at all.

The paper's block is ``y = v + g(f(z))`` with ``f`` and ``g`` position-wise (MATH.md 1). A core
(linears with a nonlinearity between them, read from one ``z``) whose output reaches no residual
add except through a token mixer is no such block: in multi-head latent attention (DeepSeek-V2/3)
``q_a_proj -> norm -> q_b_proj`` feeds the attention scores, and a BERT-style LM-head transform
feeds only the logits. Such a core is no candidate, so it is a note, never a rejection: the
blocks around it absorb what it computes (their targets are the full run's values).
"""

from __future__ import annotations

import torch
from torch import fx

from ctxc.passes.locate.block_map import LinearSite, Rejection
from ctxc.passes.locate.find_mlp_core import MlpCore
from ctxc.passes.locate.graph_view import GraphView, op_name
from ctxc.passes.locate.match_linears import ADDS

__all__ = ["not_a_branch", "unmatched_weights"]

aten = torch.ops.aten

_PRODUCTS = frozenset({aten.mul.Tensor, aten.mul_.Tensor})
# Ops that apply a matrix to rows, by the operand that holds the matrix.
_MATRIX_OPS = {"aten.linear": 1, "aten.matmul": 1, "aten.mm": 1}


def not_a_branch(view: GraphView, core: MlpCore) -> str | None:
    """Why ``core`` is no residual MLP branch, or None when it may be one.

    Walks forward from the outer linear's output, stopping at token mixers; the core may be a
    branch when the walk meets an addition that merges it with another stream (an input-
    dependent operand that does not descend from the core: the residual, or any other; the
    tail analysis then says why it fails).

    Args:
        view: the graph.
        core: the MLP core.

    Returns:
        the note (naming the token mixer that stops every path, if any), or None.
    """
    start = view.by_name[core.outer.node]
    after = view.descendants(start)
    seen: set[fx.Node] = {start}
    todo = [start]
    mixers: list[str] = []
    while todo:
        cur = todo.pop()
        for u in view.tensor_users(cur):
            if u in seen:
                continue
            seen.add(u)
            if view.is_token_mixing(u):
                mixers.append(op_name(u))
                continue
            mixed = _mixed_factor(view, core, u, cur, after)
            if mixed is not None:
                mixers.append(f"{op_name(u)} by the output of {mixed}")
                continue
            if u.op == "call_function" and u.target in ADDS:
                others = [a for a in u.args if isinstance(a, fx.Node) and a is not cur]
                if any(a in view.input_dependent and a not in after for a in others):
                    return None  # merges with another stream: may be a residual add
            todo.append(u)
    if mixers:
        return (
            f"not an MLP branch: its output reaches the residual stream only through a token "
            f"mixer ({sorted(set(mixers))[0]})"
        )
    return "not a residual block: its output reaches no residual add (an output head)"


def _mixed_factor(
    view: GraphView, core: MlpCore, u: fx.Node, cur: fx.Node, after: set[fx.Node]
) -> str | None:
    """The token mixer behind the other factor of a product ``u = cur * other``, if any.

    A factor computed through a token mixer after ``z`` (KDA's output gate multiplies the
    attention output) makes the branch depend on other positions: no position-wise ``g``.
    """
    if u.op != "call_function" or u.target not in _PRODUCTS:
        return None
    z_anc = view.ancestors(core.z)
    for a in u.args:
        if not isinstance(a, fx.Node) or a is cur or a in after or a not in view.input_dependent:
            continue
        for m in view.ancestors(a):
            if m not in z_anc and view.is_token_mixing(m):
                return op_name(m)
    return None


def unmatched_weights(view: GraphView, sites: dict[fx.Node, LinearSite]) -> list[Rejection]:
    """Matrix products whose weight is a parameter read through another op (no matcher's).

    A weight sliced from a bank in a way no matcher takes (``match_split_bank`` takes JetMoE's
    ``select(bank, 0, i)`` on chunk ``i`` of a split; a slice chosen another way, or a loop
    over the experts a routing hits, is none): no MLP core is found. One entry per module,
    naming the op that reads the parameter.

    Args:
        view: the graph.
        sites: the matched linears.

    Returns:
        a :class:`Rejection` per module path with such a product, in graph order.
    """
    found: dict[str, Rejection] = {}
    for node in view.nodes:
        pos = _MATRIX_OPS.get(op_name(node)) if node.op == "call_function" else None
        if pos is None or node in sites or len(node.args) <= pos:
            continue
        w = node.args[pos]
        if not isinstance(w, fx.Node) or w.op != "call_function" or not view.param_only(w):
            continue
        roots = [r for a in w.args if isinstance(a, fx.Node) and (r := view.param_root(a))]
        path = view.module_path(node)
        if not roots or path in found:
            continue
        name = view.param_name(roots[0])
        found[path] = Rejection(
            path,
            f"{op_name(node)} reads {name} through {op_name(w)} {list(w.args[1:])}: no linear "
            f"matcher takes a weight sliced from a parameter bank, so no MLP core is found",
        )
    return list(found.values())
