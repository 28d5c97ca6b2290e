"""Analysis: whether an MLP-shaped core is a residual MLP branch at all.

The paper's block is ``y = v + g(f(z))`` with ``f`` and ``g`` position-wise (MATH.md 1). A core
(linears with a nonlinearity between them, read from one ``z``) whose output reaches no residual
add except through a token mixer is no such block: in multi-head latent attention (DeepSeek-V2/3)
``q_a_proj -> norm -> q_b_proj`` feeds the attention scores, and a BERT-style LM-head transform
feeds only the logits. Such a core is no candidate, so it is a note, never a rejection: the
blocks around it absorb what it computes (their targets are the full run's values).
"""

from __future__ import annotations

from torch import fx

from ctxc.passes.find_mlp_core import MlpCore
from ctxc.passes.graph_view import GraphView, op_name
from ctxc.passes.match_linears import ADDS

__all__ = ["not_a_branch"]


def not_a_branch(view: GraphView, core: MlpCore) -> str | None:
    """Why ``core`` is no residual MLP branch, or None when it may be one.

    Walks forward from the outer linear's output, stopping at token mixers; the core may be a
    branch when the walk meets an addition whose other operand carries an ancestor of ``z``
    (the residual).

    Args:
        view: the graph.
        core: the MLP core.

    Returns:
        the note (naming the token mixer that stops every path, if any), or None.
    """
    z_anc = view.ancestors(core.z) | {core.z}
    start = view.by_name[core.outer.node]
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
            if u.op == "call_function" and u.target in ADDS:
                others = [a for a in u.args if isinstance(a, fx.Node) and a is not cur]
                if any(a in z_anc for a in others):
                    return None
            todo.append(u)
    if mixers:
        return (
            f"not an MLP branch: its output reaches the residual stream only through a token "
            f"mixer ({sorted(set(mixers))[0]})"
        )
    return "not a residual block: its output reaches no residual add (an output head)"
