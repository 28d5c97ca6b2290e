"""Analysis: the ops from an MLP core's outer output down to the residual add.

The tail is a chain of ops the solver can invert: casts, row-keeping reshapes, dropout,
constant gains (Granite), additions of other terms (the attention output of a parallel block, a
shared expert), per-row gates (a shared expert's sigmoid gate), the per-token sum of an expert
bank's weighted rows, and at most one norm with a trainable scale or bias (OLMo 2, Gemma 2/3
post norms). The chain ends at the first addition whose other operand carries an ancestor of
``z``: the residual ``v``. Any other op ends the walk with a :class:`Rejection` that names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import sympy
import torch
from torch import fx

from ctxc.passes.locate.block_map import ExpertOutput, NormSite, Rejection, StepKind, TailStep
from ctxc.passes.locate.find_mlp_core import MlpCore
from ctxc.passes.locate.graph_view import VIEW_LIKE, GraphView, arg_node, op_name
from ctxc.passes.locate.match_linears import ADDS
from ctxc.passes.locate.match_norms import FUSED_NORMS, fused_norm, scale_site, written_norm

__all__ = ["Tail", "follow_tail", "last_norm"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Tail:
    """An MLP core's way to the residual add.

    Attributes:
        core: the core.
        y: the residual add.
        v: the residual stream it takes back in.
        branch: the operand of ``y`` on the core's side.
        chain: the steps from the outer output to ``y``, markers (norm, scale, combine) included.
        norm: the post norm, if any.
        experts: how an expert bank's rows are summed per token, for an MoE core.
    """

    core: MlpCore
    y: fx.Node
    v: fx.Node
    branch: fx.Node
    chain: tuple[TailStep, ...]
    norm: NormSite | None
    experts: ExpertOutput | None


def follow_tail(view: GraphView, core: MlpCore) -> Tail | Rejection:
    """Walk from the outer linear's output to the residual add, classifying every op.

    Args:
        view: the graph.
        core: the MLP core.

    Returns:
        the tail, or a :class:`Rejection` at the core's path naming the op that cannot be
        inverted (with its value).
    """
    where = core.path
    z_anc = view.ancestors(core.z) | {core.z}
    cur = view.by_name[core.outer.node]
    chain: list[TailStep] = []
    norm: NormSite | None = None
    experts: ExpertOutput | None = None
    if core.outer.experts:
        found = _expert_combine(view, core, cur)
        if isinstance(found, Rejection):
            return found
        experts, cur = found
        chain.append(TailStep(StepKind.COMBINE, cur.name))
    while True:
        users = view.tensor_users(cur)
        if not users:
            return Rejection(where, "the outer output reaches no residual add")
        if len(users) > 1:
            found_norm = _branching_norm(view, where, cur, users, norm)
            if isinstance(found_norm, Rejection):
                return found_norm
            norm, cur = found_norm
            chain.append(TailStep(StepKind.NORM, cur.name))
            continue
        u = users[0]
        step = _step(view, where, u, cur, norm, chain)
        if isinstance(step, Rejection):
            return step
        with_step = _with_step(view, where, step, u, cur, norm)
        if isinstance(with_step, Rejection):
            return with_step
        norm = with_step
        chain.append(step)
        cur = u
        if step.kind == StepKind.ADD and step.side is not None:
            side = view.by_name[step.side]
            v = _residual_leaf(view, side, z_anc)
            if v is not None:
                branch = next(a for a in u.args if isinstance(a, fx.Node) and a is not side)
                return Tail(core, u, v, branch, tuple(chain), norm, experts)


def last_norm(chain: tuple[TailStep, ...] | list[TailStep]) -> int:
    """The index of the last norm marker in ``chain``, or -1."""
    for i in range(len(chain) - 1, -1, -1):
        if chain[i].kind == StepKind.NORM:
            return i
    return -1


def _branching_norm(
    view: GraphView, where: str, cur: fx.Node, users: list[fx.Node], norm: NormSite | None
) -> tuple[NormSite, fx.Node] | Rejection:
    """A value read by several ops on the way: only a written-out norm's input may be."""
    if norm is not None:
        return Rejection(where, "a second norm after the post norm: not supported")
    found = written_norm(view, cur)
    if found is None:
        ops = ", ".join(op_name(u) for u in users)
        return Rejection(where, f"the outer output feeds {len(users)} ops ({ops}), not one chain")
    return found


def _with_step(
    view: GraphView, where: str, step: TailStep, u: fx.Node, cur: fx.Node, norm: NormSite | None
) -> NormSite | Rejection | None:
    """The post norm as it stands after ``step`` (a norm, its scale or its bias)."""
    if step.kind == StepKind.NORM:
        return fused_norm(view, u)
    if step.kind == StepKind.SCALE:
        assert norm is not None
        scale = scale_site(view, u, cur)
        if scale is None:
            return Rejection(where, f"post norm is multiplied by {op_name(u)}: not a scale")
        return replace(norm, scale=scale)
    if step.kind == StepKind.BIAS:
        assert norm is not None and step.side is not None
        return replace(norm, bias=view.param_name(view.by_name[step.side]), bias_node=u.name)
    return norm


def _step(
    view: GraphView,
    where: str,
    u: fx.Node,
    cur: fx.Node,
    norm: NormSite | None,
    chain: list[TailStep],
) -> TailStep | Rejection:
    """The tail step ``u`` computes from ``cur``, or the reason it is not invertible."""
    target = u.target
    others = [a for a in u.args if a is not cur]
    if u.op != "call_function":
        return Rejection(where, f"outer function has op {op_name(u)}: not output-controllable")
    if target in VIEW_LIKE or view.keeps_rows(u):
        return TailStep(StepKind.VIEW, u.name)
    if target in FUSED_NORMS and u.args[0] is cur:
        if norm is not None:
            return Rejection(where, "a second norm after the post norm: not supported")
        return TailStep(StepKind.NORM, u.name)
    since_norm = chain[last_norm(chain) + 1 :]
    if target in ADDS and len(others) == 1:
        return _add_step(view, where, u, others[0], norm, since_norm)
    if target == aten.mul.Tensor and len(others) == 1:
        return _mul_step(view, where, u, cur, others[0], norm, since_norm)
    if target == aten.div.Tensor and u.args[0] is cur and isinstance(u.args[1], int | float):
        if not u.args[1]:
            return Rejection(where, "branch is divided by 0")
        return TailStep(StepKind.GAIN, u.name, factor=1.0 / float(u.args[1]))
    return Rejection(where, f"outer function has op {op_name(u)}: not output-controllable")


def _add_step(
    view: GraphView,
    where: str,
    u: fx.Node,
    other: object,
    norm: NormSite | None,
    since_norm: list[TailStep],
) -> TailStep | Rejection:
    """``cur + other``: the post norm's bias right after it (and its scale), else an addend."""
    if not (isinstance(other, fx.Node) and view.is_tensor(other)):
        return Rejection(
            where, f"outer output is shifted by a constant ({op_name(u)} {other!r}): not supported"
        )
    root = view.param_root(other)
    if (
        root is not None
        and norm is not None
        and norm.bias is None
        and all(s.kind in (StepKind.VIEW, StepKind.SCALE) for s in since_norm)
    ):
        return TailStep(StepKind.BIAS, u.name, side=root.name)
    return TailStep(StepKind.ADD, u.name, side=other.name)


def _mul_step(
    view: GraphView,
    where: str,
    u: fx.Node,
    cur: fx.Node,
    other: object,
    norm: NormSite | None,
    since_norm: list[TailStep],
) -> TailStep | Rejection:
    """``cur * other``: a constant gain, a written norm's scale, or a per-row gate."""
    if isinstance(other, int | float):
        factor = float(other)
        if not math.isfinite(factor) or factor == 0.0:
            return Rejection(where, f"branch is multiplied by {factor}: not output-controllable")
        return TailStep(StepKind.GAIN, u.name, factor=factor)
    if not view.is_tensor(other):
        return Rejection(where, f"outer function has op {op_name(u)}: not output-controllable")
    assert isinstance(other, fx.Node)
    if other not in view.input_dependent:
        right_after_norm = (
            norm is not None
            and norm.fused is None
            and norm.scale is None
            and all(s.kind == StepKind.VIEW for s in since_norm)
        )
        if right_after_norm:
            return TailStep(StepKind.SCALE, u.name, side=other.name)
        return Rejection(
            where,
            f"outer output is multiplied by a parameter tensor ({op_name(u)}) outside a norm: "
            "not supported",
        )
    if _is_row_gate(view, other, cur):
        return TailStep(StepKind.GATE, u.name, side=other.name)
    return Rejection(
        where,
        "outer output is multiplied element-wise by another activation: not output-controllable",
    )


def _is_row_gate(view: GraphView, gate: fx.Node, x: fx.Node) -> bool:
    """``gate`` scales each row of ``x`` by one number ([rows, 1] or [rows])."""
    g = view.rows(gate)
    return g is not None and g[1] == 1 and view.same_rows(gate, x)


def _residual_leaf(view: GraphView, side: fx.Node, z_anc: set[fx.Node]) -> fx.Node | None:
    """The term of ``side``'s sum that lies upstream of ``z`` (the residual ``v``), if any."""
    stack = [side]
    while stack:
        n = stack.pop()
        if n in z_anc or view.row_source(n) in z_anc:  # OPT adds z's flattened rows back
            return n
        single = len(view.tensor_users(n)) == 1 and n.op == "call_function"
        if single and n.target in ADDS:
            stack.extend(a for a in n.args if view.is_tensor(a))
        elif single and (n.target in VIEW_LIKE or view.keeps_rows(n)):
            stack.append(arg_node(n))
        elif single and (scaled := _scaled_term(view, n)) is not None:
            stack.append(scaled)
    return None


def _scaled_term(view: GraphView, n: fx.Node) -> fx.Node | None:
    """``x`` when ``n = x * c`` with ``c`` a number or weights only, else None.

    A residual carried back scaled (Doge's ``r * v``, Beam's depth-scaled add, MiniMax's
    ``alpha * z``) is still the residual: the solver subtracts the add's other operand as it
    is (``block_moves.control_target``), so a factor on that side puts no condition on the move.
    """
    if n.target != aten.mul.Tensor or len(n.args) != 2:
        return None
    a, b = n.args
    for x, c in ((a, b), (b, a)):
        if not (isinstance(x, fx.Node) and view.is_tensor(x)):
            continue
        if isinstance(c, int | float) or (isinstance(c, fx.Node) and view.param_only(c)):
            return x
    return None


def _expert_combine(
    view: GraphView, core: MlpCore, cur: fx.Node
) -> tuple[ExpertOutput, fx.Node] | Rejection:
    """From an expert bank's rows to the per-token sum: ``sum(view(rows * gate, [T, k, d]), 1)``."""
    where = core.path
    gate: fx.Node | None = None
    while True:
        users = view.tensor_users(cur)
        if len(users) != 1:
            return Rejection(where, "expert outputs feed several ops: no per-token sum found")
        u = users[0]
        total = _per_token_sum(view, u) or _index_sum(view, u, cur)
        if total is not None:
            if gate is None:
                return Rejection(where, "expert rows are summed without routing weights")
            node, top_k, tokens = total
            weight = next(n for n, p in view.param_of.items() if p == core.outer.weight)
            experts = int((view.shape(view.by_name[weight]) or (0,))[0] or 0)
            return ExpertOutput(gate.name, node.name, top_k, experts, tokens), node
        if u.target in VIEW_LIKE or view.keeps_rows(u):
            cur = u
            continue
        others = [a for a in u.args if a is not cur]
        if u.target in ADDS and len(others) == 1 and _expert_bias(view, others[0]):
            cur = u  # each row's expert bias (GPT-OSS): a constant the move leaves in place
            continue
        if u.target == aten.mul.Tensor and gate is None and len(others) == 1:
            other = others[0]
            if view.is_tensor(other) and _is_row_gate(view, other, cur):
                gate, cur = other, u
                continue
        return Rejection(
            where, f"expert outputs go through {op_name(u)} before their per-token sum"
        )


def _expert_bias(view: GraphView, other: object) -> bool:
    """``other`` is a per-row constant: weights only, or a bias gathered by expert ids."""
    if not isinstance(other, fx.Node) or not view.is_tensor(other):
        return False
    return view.param_only(other) or view.param_gather(view.see_through(other)) is not None


def _per_token_sum(view: GraphView, u: fx.Node) -> tuple[fx.Node, int, None] | None:
    """``(sum, top_k, None)`` when ``u = view(rows, [T, top_k, d])`` is summed over its rows."""
    shape = view.shape(u)
    if u.target not in (aten.view.default, aten.reshape.default) or not shape or len(shape) != 3:
        return None
    sums = view.tensor_users(u)
    top_k = shape[1]
    if (
        len(sums) == 1
        and sums[0].target == aten.sum.dim_IntList
        and isinstance(dims := sums[0].args[1], list | tuple)
        and list(dims) in ([1], [-2])
        and isinstance(top_k, int)
    ):
        return sums[0], top_k, None
    return None


_ZEROS = frozenset({aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default})


def _index_sum(view: GraphView, u: fx.Node, rows: fx.Node) -> tuple[fx.Node, int, str] | None:
    """``(sum, top_k, tokens)`` when ``u = index_add(zeros, 0, tokens, rows)`` adds each row
    into its token's (JetMoE); ``top_k`` is the rows per token where the shapes fix it, else 0."""
    if u.target != aten.index_add.default or u.args[1] not in (0, -len(view.shape(u) or (0,))):
        return None
    base, tokens, src = u.args[0], u.args[2], u.args[3]
    if src is not rows or not isinstance(base, fx.Node) or base.target not in _ZEROS:
        return None
    if not isinstance(tokens, fx.Node) or len(view.shape(tokens) or ()) != 1:
        return None
    return u, _ratio(tokens, u), tokens.name


def _ratio(rows: fx.Node, tokens: fx.Node) -> int:
    """``len(rows) / len(tokens)`` (first dimensions) when it is a whole number, else 0."""
    a, b = rows.meta["val"].shape[0], tokens.meta["val"].shape[0]
    ea = a.node.expr if isinstance(a, torch.SymInt) else sympy.Integer(a)
    eb = b.node.expr if isinstance(b, torch.SymInt) else sympy.Integer(b)
    q = sympy.simplify(ea / eb)
    return int(q) if q.is_Integer and q > 0 else 0
