"""Analysis: find every residual MLP block in a traced decoder, from ops and data flow.

A block is recognised by what it computes, never by ``model_type`` (DESIGN.md):

1. Linear maps: ``aten.linear``; ``addmm`` with the weight stored [in, out] (GPT-2's Conv1D)
   or transposed; ``matmul`` with a transposed weight and a separate bias add (Falcon); a
   stacked expert bank ``bmm(W[ids], x)`` (MoE experts with ``batched_mm``).
2. An MLP core: an outer linear whose input ``h`` is computed, without mixing tokens, from the
   outputs of inner linears that all read one input ``z`` (through reshapes; the router and the
   expert banks of an MoE read it too). Found by walking upstream from ``h`` and stopping at the
   first linears met: the walk fails when it mixes tokens or reaches linears that read other
   tensors (an attention output projection, the LM head).
3. Its tail: from the outer output down to the residual add, a chain of ops the solver can
   invert: casts, row-keeping reshapes, dropout, constant gains (Granite), additions of other
   terms (the attention output of a parallel block, a shared expert), per-row gates (a shared
   expert's sigmoid gate), the per-token sum of an expert bank's weighted rows, and at most one
   norm with a trainable scale or bias (OLMo 2, Gemma 2/3 post norms). The chain ends at the
   first addition whose other operand carries an ancestor of ``z``: the residual ``v``.

Every core whose tail cannot be inverted is a :class:`Rejection` with the reason (MATH.md 5:
a post norm with no trainable scale or bias has a fixed RMS, so no patch reaches the target).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from torch import fx

from ctxc.passes.block_map import (
    BlockMap,
    ExpertOutput,
    LinearSite,
    MlpBlock,
    NormSite,
    Rejection,
    ScaleSite,
    TailStep,
)
from ctxc.passes.graph_view import ELEMENTWISE, TRANSPOSES, VIEW_LIKE, GraphView, op_name
from ctxc.trace import TracedModel

__all__ = ["locate_blocks"]

aten = torch.ops.aten

_ADDS = frozenset({aten.add.Tensor, aten.add_.Tensor})
_FUSED_NORMS = frozenset({aten.layer_norm.default, aten.rms_norm.default})
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
_NORM_WINDOW = 40  # nodes: a written-out norm closes within this many ops of its input
_CORE_LIMIT = 400  # nodes: an MLP's inner function is small; stop walks that leak out of it


@dataclass(frozen=True)
class _Core:
    outer: LinearSite
    z: fx.Node
    inner: tuple[LinearSite, ...]
    path: str


@dataclass(frozen=True)
class _Tail:
    core: _Core
    y: fx.Node
    v: fx.Node
    branch: fx.Node
    chain: tuple[TailStep, ...]  # from the outer output to y, markers included
    norm: NormSite | None
    experts: ExpertOutput | None


def locate_blocks(traced: TracedModel, view: GraphView | None = None) -> BlockMap:
    """Find the residual MLP blocks of ``traced`` and explain every candidate it rejects.

    Args:
        traced: the exported model.
        view: a :class:`GraphView` of it, when the caller already has one.

    Returns:
        a frozen :class:`BlockMap`; the graph is not modified.
    """
    view = view or GraphView(traced)
    sites: dict[fx.Node, LinearSite] = {}
    for n in view.nodes:
        site = _linear_site(view, n)
        if site is not None:
            sites[view.by_name[site.node]] = site
    tails: list[_Tail] = []
    failed: list[tuple[_Core, Rejection]] = []
    for site in sites.values():
        core = _mlp_core(view, site, sites)
        if core is None:
            continue
        found = _follow_tail(view, core)
        if isinstance(found, Rejection):
            failed.append((core, found))
        else:
            tails.append(found)
    groups: dict[fx.Node, list[_Tail]] = {}
    for tail in tails:
        groups.setdefault(tail.y, []).append(tail)
    blocks: list[MlpBlock] = []
    rejections: list[Rejection] = []
    for y in sorted(groups, key=view.index.__getitem__):
        found = _assemble(view, groups[y], sites)
        (blocks if isinstance(found, MlpBlock) else rejections).append(found)
    # A core whose own tail fails but whose input feeds a located block is part of that block's
    # inner function (a shared expert): not a rejection of its own.
    covered = {b.mlp_in for b in blocks}
    for core, rejection in failed:
        if core.z.name not in covered and rejection not in rejections:
            rejections.append(rejection)
    rejections.sort(key=lambda r: _path_key(r.where))
    linears = {view.by_name[s.node]: s for s in sites.values()}
    return BlockMap(tuple(blocks), tuple(rejections), head=_locate_head(view, linears))


# -- linear maps ---------------------------------------------------------------------------------


def _param_matrix(view: GraphView, node: fx.Node) -> tuple[fx.Node, bool] | None:
    """``(param, transposed)`` when ``node`` is a 2-D parameter, possibly cast or transposed."""
    transposed = False
    while node.op == "call_function":
        if node.target in VIEW_LIKE:
            node = node.args[0]
        elif node.target in TRANSPOSES or (
            node.target == aten.permute.default and list(node.args[1]) in ([1, 0], [-1, -2])
        ):
            transposed = not transposed
            node = node.args[0]
        else:
            break
        if not isinstance(node, fx.Node):
            return None
    val = node.meta.get("val")
    if view.is_param(node) and isinstance(val, torch.Tensor) and val.dim() == 2:
        return node, transposed
    return None


def _linear_site(view: GraphView, node: fx.Node) -> LinearSite | None:
    """A ``LinearSite`` when ``node`` multiplies an activation by a parameter matrix."""
    if node.op != "call_function" or node not in view.input_dependent:
        return None
    out = node
    bias: fx.Node | None = None
    repeat = 1
    experts: str | None = None
    if node.target == aten.linear.default:
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        weight = view.param_root(w) if isinstance(w, fx.Node) else None
        bias = view.param_root(b) if isinstance(b, fx.Node) else None
        layout = "out_in"
    elif node.target in (aten.addmm.default, aten.matmul.default, aten.mm.default):
        if node.target == aten.addmm.default:  # GPT-2 Conv1D: addmm(bias, x, W[in, out])
            b, x, w = node.args[0], node.args[1], node.args[2]
            bias = view.param_root(b) if isinstance(b, fx.Node) else None
        else:  # Falcon: x @ W.T, then + bias
            x, w = node.args[0], node.args[1]
        if not isinstance(w, fx.Node) or (found := _param_matrix(view, w)) is None:
            return None
        weight, transposed = found
        layout = "out_in" if transposed else "in_out"
        users = view.tensor_users(node)
        if bias is None and len(users) == 1 and users[0].target in _ADDS:
            other = [a for a in users[0].args if isinstance(a, fx.Node) and a is not node]
            root = view.param_root(other[0]) if len(other) == 1 else None
            if root is not None and len(view.shape(root) or ()) == 1:
                bias, out = root, users[0]
    elif node.target == aten.bmm.default:
        found_bank = _bank(view, node)
        if found_bank is None:
            return None
        weight, x, out, layout, ids = found_bank
        experts = ids.name
        if x.op == "call_function" and x.target == aten.repeat_interleave.self_int:
            repeat = int(x.args[1]) if isinstance(x.args[1], int) else 1
            source = view.row_source(x.args[0])
        else:
            source = view.row_source(x)
        return LinearSite(
            node=out.name,
            input=x.name,
            weight=view.param_name(weight),
            bias=None,
            module=view.module_path(node),
            layout=layout,
            op=op_name(node),
            experts=experts,
            repeat=repeat,
            source=source.name,
        )
    else:
        return None
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


def _bank(view: GraphView, node: fx.Node):
    """``(param, x, out, layout, ids)`` for ``bmm(W[ids], x[..., None])`` and its transpose."""
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
    if len(view.shape(param) or ()) != 3 or not isinstance(unsq.args[0], fx.Node):
        return None
    return param, unsq.args[0], users[0], layout, ids


# -- MLP cores -----------------------------------------------------------------------------------


def _mlp_core(view: GraphView, site: LinearSite, sites: dict[fx.Node, LinearSite]) -> _Core | None:
    """The MLP whose outer linear is ``site``, or None when ``site`` is not one."""
    starts = [view.by_name[site.input]]
    if site.experts:
        starts.append(view.by_name[site.experts])
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
            return None
        if n in sites and n is not own:
            inner = sites[n]
            src = view.by_name[inner.source]
            if source is not None and src is not source:
                return None  # linears that read different tensors: not one MLP input
            source = src
            frontier[n] = inner
            if inner.experts:  # the bank's rows are chosen by the router: walk it too
                stack.append(view.by_name[inner.experts])
            continue
        if n.op == "placeholder" or view.is_token_mixing(n):
            return None
        stack.extend(a for a in _tensor_args(view, n) if a in view.input_dependent)
    if source is None:
        return None
    inner = tuple(sorted(frontier.values(), key=lambda s: view.index[view.by_name[s.node]]))
    path = _common_module([s.module for s in (*inner, site)]) or view.module_path(own)
    return _Core(outer=site, z=source, inner=inner, path=path)


def _tensor_args(view: GraphView, node: fx.Node) -> list[fx.Node]:
    return view.value_args(node)


# -- tails ---------------------------------------------------------------------------------------


def _follow_tail(view: GraphView, core: _Core) -> _Tail | Rejection:
    """Walk from the outer linear's output to the residual add, classifying every op."""
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
        chain.append(TailStep("combine", cur.name))
    while True:
        users = view.tensor_users(cur)
        if not users:
            return Rejection(where, "the outer output reaches no residual add")
        if len(users) > 1:
            if norm is not None:
                return Rejection(where, "a second norm after the post norm: not supported")
            found_norm = _written_norm(view, cur)
            if found_norm is None:
                ops = ", ".join(op_name(u) for u in users)
                return Rejection(
                    where, f"the outer output feeds {len(users)} ops ({ops}), not one chain"
                )
            norm, cur = found_norm
            chain.append(TailStep("norm", cur.name))
            continue
        u = users[0]
        step = _step(view, u, cur, norm, chain)
        if isinstance(step, str):
            return Rejection(where, step)
        if step.kind == "norm":
            norm = _fused_norm(view, u)
        elif step.kind == "scale":
            assert norm is not None
            scale = _scale_site(view, u, cur)
            if scale is None:
                return Rejection(where, f"post norm is multiplied by {op_name(u)}: not a scale")
            norm = replace(norm, scale=scale)
        elif step.kind == "bias":
            assert norm is not None and step.side is not None
            norm = replace(norm, bias=view.param_name(view.by_name[step.side]), bias_node=u.name)
        chain.append(step)
        cur = u
        if step.kind == "add" and step.side is not None:
            side = view.by_name[step.side]
            v = _residual_leaf(view, side, z_anc)
            if v is not None:
                return _Tail(core, u, v, _chain_operand(u, side), tuple(chain), norm, experts)


def _chain_operand(add: fx.Node, side: fx.Node) -> fx.Node:
    return next(a for a in add.args if isinstance(a, fx.Node) and a is not side)


def _step(
    view: GraphView, u: fx.Node, cur: fx.Node, norm: NormSite | None, chain: list[TailStep]
) -> TailStep | str:
    """The tail step ``u`` computes from ``cur``, or the reason it is not invertible."""
    target = u.target
    others = [a for a in u.args if a is not cur]
    if u.op != "call_function":
        return f"outer function has op {op_name(u)}: not output-controllable"
    if target in VIEW_LIKE or view.keeps_rows(u):
        return TailStep("view", u.name)
    if target in _FUSED_NORMS and u.args[0] is cur:
        if norm is not None:
            return "a second norm after the post norm: not supported"
        return TailStep("norm", u.name)
    after_norm = norm is not None and norm.fused is None and norm.scale is None
    after_norm = after_norm and all(s.kind == "view" for s in chain[_last_norm(chain) + 1 :])
    if target in _ADDS and len(others) == 1:
        other = others[0]
        if isinstance(other, fx.Node) and view.is_tensor(other):
            root = view.param_root(other)
            if (
                root is not None
                and norm is not None
                and norm.bias is None
                and all(s.kind in ("view", "scale") for s in chain[_last_norm(chain) + 1 :])
            ):
                return TailStep("bias", u.name, side=root.name)
            return TailStep("add", u.name, side=other.name)
        return f"outer output is shifted by a constant ({op_name(u)} {other!r}): not supported"
    if target == aten.mul.Tensor and len(others) == 1:
        other = others[0]
        if isinstance(other, int | float):
            factor = float(other)
            if not math.isfinite(factor) or factor == 0.0:
                return f"branch is multiplied by {factor}: not output-controllable"
            return TailStep("gain", u.name, factor=factor)
        if not view.is_tensor(other):
            return f"outer function has op {op_name(u)}: not output-controllable"
        if other not in view.input_dependent:
            if after_norm:
                return TailStep("scale", u.name, side=other.name)
            return (
                f"outer output is multiplied by a parameter tensor ({op_name(u)}) outside a "
                "norm: not supported"
            )
        if _is_row_gate(view, other, cur):
            return TailStep("gate", u.name, side=other.name)
        return (
            "outer output is multiplied element-wise by another activation: not output-controllable"
        )
    if target == aten.div.Tensor and u.args[0] is cur and isinstance(u.args[1], int | float):
        if not u.args[1]:
            return "branch is divided by 0"
        return TailStep("gain", u.name, factor=1.0 / float(u.args[1]))
    return f"outer function has op {op_name(u)}: not output-controllable"


def _last_norm(chain: list[TailStep]) -> int:
    for i in range(len(chain) - 1, -1, -1):
        if chain[i].kind == "norm":
            return i
    return -1


def _is_row_gate(view: GraphView, gate: fx.Node, x: fx.Node) -> bool:
    """``gate`` scales each row of ``x`` by one number ([rows, 1] or [rows])."""
    g, r = view.rows(gate), view.rows(x)
    return g is not None and r is not None and g[0] == r[0] and g[1] == 1


def _residual_leaf(view: GraphView, side: fx.Node, z_anc: set[fx.Node]) -> fx.Node | None:
    """The term of ``side``'s sum that lies upstream of ``z`` (the residual ``v``), if any."""
    stack = [side]
    while stack:
        n = stack.pop()
        if n in z_anc or view.row_source(n) in z_anc:  # OPT adds z's flattened rows back
            return n
        single = len(view.tensor_users(n)) == 1 and n.op == "call_function"
        if single and n.target in _ADDS:
            stack.extend(a for a in n.args if view.is_tensor(a))
        elif single and (n.target in VIEW_LIKE or view.keeps_rows(n)):
            stack.append(n.args[0])
    return None


def _expert_combine(
    view: GraphView, core: _Core, cur: fx.Node
) -> tuple[ExpertOutput, fx.Node] | Rejection:
    """From an expert bank's rows to the per-token sum: ``sum(view(rows * gate, [T, k, d]), 1)``."""
    where = core.path
    gate: fx.Node | None = None
    while True:
        users = view.tensor_users(cur)
        if len(users) != 1:
            return Rejection(where, "expert outputs feed several ops: no per-token sum found")
        u = users[0]
        shape = view.shape(u)
        if u.target in (aten.view.default, aten.reshape.default) and shape and len(shape) == 3:
            sums = view.tensor_users(u)
            top_k = shape[1]
            if (
                len(sums) == 1
                and sums[0].target == aten.sum.dim_IntList
                and list(sums[0].args[1]) in ([1], [-2])
                and isinstance(top_k, int)
            ):
                if gate is None:
                    return Rejection(where, "expert rows are summed without routing weights")
                weight = view.by_name[
                    next(n for n, p in view.param_of.items() if p == core.outer.weight)
                ]
                experts = int((view.shape(weight) or (0,))[0] or 0)
                return ExpertOutput(gate.name, sums[0].name, top_k, experts), sums[0]
        if u.target in VIEW_LIKE or view.keeps_rows(u):
            cur = u
            continue
        others = [a for a in u.args if a is not cur]
        if u.target == aten.mul.Tensor and gate is None and len(others) == 1:
            other = others[0]
            if view.is_tensor(other) and _is_row_gate(view, other, cur):
                gate, cur = other, u
                continue
        return Rejection(
            where, f"expert outputs go through {op_name(u)} before their per-token sum"
        )


# -- norms ---------------------------------------------------------------------------------------


def _written_norm(view: GraphView, start: fx.Node) -> tuple[NormSite, fx.Node] | None:
    """A norm written out op by op from ``start``: ``(site, normalised node)``, or None.

    The normalised value is where every path from ``start`` meets again (``x * rsqrt(...)``):
    the first node after which no op of the region has a user outside it.
    """
    region: list[fx.Node] = []
    inside = {start}
    first = view.index[start] + 1
    for n in view.nodes[first : first + _NORM_WINDOW]:
        if not any(a in inside for a in _tensor_args(view, n)):
            continue
        region.append(n)
        inside.add(n)
        done = all(set(view.tensor_users(m)) <= inside for m in [start, *region[:-1]])
        if done:
            break
    else:
        return None
    ops = {m.target for m in region}
    if not ops <= _NORM_OPS or aten.mean.dim not in ops:
        return None
    if not ops & {aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default}:
        return None
    for m in region:  # a weight inside the region (w * x * rsqrt): not a plain normalisation
        if any(a not in view.input_dependent for a in _tensor_args(view, m)):
            return None
    p = region[-1]
    site = NormSite(
        module=view.module_path(p),
        input=start.name,
        centered=aten.sub.Tensor in ops,
    )
    return site, p


def _fused_norm(view: GraphView, node: fx.Node) -> NormSite:
    """A fused ``aten.layer_norm(x, shape, w, b, eps)`` or ``aten.rms_norm(x, shape, w, eps)``."""
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
        input=node.args[0].name,
        centered=layer,
        fused=op_name(node),
        eps=float(eps) if isinstance(eps, int | float) else 1e-5,
        scale=scale,
        bias=view.param_name(bias) if bias is not None else None,
        bias_node=node.name if bias is not None else None,
    )


def _scale_site(view: GraphView, mul: fx.Node, normalized: fx.Node) -> ScaleSite | None:
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


def _norm_output(view: GraphView, node: fx.Node) -> bool:
    """Is ``node`` the output of a norm (fused, or ``x * rsqrt(...)`` and an affine after it)?"""
    for _ in range(8):
        if node.op != "call_function":
            return False
        if node.target in _FUSED_NORMS:
            return True
        if node.target in VIEW_LIKE:
            node = node.args[0]
            continue
        acts = [a for a in _tensor_args(view, node) if a in view.input_dependent]
        if node.target in (aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor) and len(acts) == 2:
            return any(
                a.op == "call_function"
                and a.target in (aten.rsqrt.default, aten.sqrt.default, aten.reciprocal.default)
                for a in acts
            )
        if node.target in (aten.mul.Tensor, aten.add.Tensor) and len(acts) == 1:
            node = acts[0]  # the affine part: times a scale, plus a bias
            continue
        return False
    return False


# -- blocks --------------------------------------------------------------------------------------


def _assemble(
    view: GraphView, tails: list[_Tail], sites: dict[fx.Node, LinearSite]
) -> MlpBlock | Rejection:
    """One block from the cores that end at the same residual add."""
    # The output move goes where MATH.md 2 puts it: the experts' outputs for an MoE (a shared
    # expert is an ordinary MLP inside f), else the one core (a dense MLP).
    tails = sorted(
        tails, key=lambda t: (t.experts is None, view.index[view.by_name[t.core.outer.node]])
    )
    main = tails[0]
    core, y, z = main.core, main.y, main.core.z
    y_anc = view.ancestors(y)
    inner: list[LinearSite] = []
    for node, site in sites.items():
        if node not in y_anc or node is view.by_name[core.outer.node]:
            continue
        if site.source != z.name:
            continue
        reach = [d for d in view.descendants(node) if d in y_anc]
        if any(view.is_token_mixing(d) for d in reach):
            continue  # attention's q/k/v of a parallel block also read z: not the MLP's
        inner.append(site)
    for site in core.inner:
        if site not in inner:
            inner.append(site)
    inner.sort(key=lambda s: view.index[view.by_name[s.node]])
    chooses: set[fx.Node] = set()
    for site in inner:
        if site.experts:
            chooses |= view.ancestors(view.by_name[site.experts])
    routers = tuple(s.node for s in inner if not s.experts and view.by_name[s.node] in chooses)
    others = [t.core.outer for t in tails[1:] if t.core.z is z and t.core.outer not in inner]
    between = y_anc & view.descendants(main.v)
    mixers = [n for n in between if view.is_token_mixing(n)]
    chain = list(main.chain)
    norm = main.norm
    control, tail, output_control = _control(view, chain, core, norm, main.experts)
    if isinstance(control, Rejection):
        return control
    pre = [s for s in chain[: _last_norm(chain)] if s.kind != "combine"] if norm else []
    stable_ok = bool(
        norm is not None
        and not norm.centered
        and norm.scale is not None
        and main.experts is None
        and all(s.kind == "view" for s in pre)
    )
    gain = 1.0
    for s in tail:
        if s.kind == "gain":
            gain *= s.factor
    z_is_norm = view.row_source(main.v) is not z and _norm_output(view, z)
    return MlpBlock(
        path=core.path,
        residual_in=main.v.name,
        residual_add=y.name,
        branch=main.branch.name,
        mlp_in=z.name,
        inner=tuple(inner),
        activation=core.outer.input,
        outer=core.outer,
        post_norm=norm.module if norm is not None else None,
        scale=norm.scale if norm is not None else None,
        gain=gain,
        output_control=output_control,
        control=control,
        tail=tuple(tail),
        norm=norm,
        experts=main.experts,
        others=tuple(others),
        parallel=bool(mixers),
        pre_norm=view.module_path(z) if z_is_norm else None,
        trailing_norm=_trailing_norm(view, y),
        stable_ok=stable_ok,
        routers=routers,
    )


def _control(
    view: GraphView,
    chain: list[TailStep],
    core: _Core,
    norm: NormSite | None,
    experts: ExpertOutput | None,
) -> tuple[str | Rejection, list[TailStep], str]:
    """Which value the output move sets, the steps from it to ``y``, and the control kind."""
    where = core.path

    def after(node: str) -> list[TailStep]:
        i = next(i for i, s in enumerate(chain) if s.node == node)
        return [_plain(s) for s in chain[i + 1 :]]

    if norm is not None:
        if norm.scale is not None and not (norm.centered and norm.bias is not None):
            return norm.scale.node, after(norm.scale.node), "scale"
        if norm.bias is not None and norm.bias_node is not None:
            return norm.bias_node, after(norm.bias_node), "bias"
        kind = "LayerNorm" if norm.centered else "RMS norm"
        reason = (
            f"post norm {norm.module} ({kind}) has no trainable scale or bias: its output has "
            "a fixed RMS, so no patch reaches an arbitrary target (not output-controllable, "
            "MATH.md 5)"
        )
        return Rejection(where, reason), [], ""
    if experts is not None:
        return experts.combine, after(experts.combine), "experts"
    return core.outer.node, [_plain(s) for s in chain], "linear"


def _plain(step: TailStep) -> TailStep:
    # After the control point a bias is one more addend, a marker is an identity.
    if step.kind == "bias":
        return TailStep("add", step.node, side=step.side)
    if step.kind in ("norm", "scale", "combine"):
        return TailStep("view", step.node)
    return step


def _trailing_norm(view: GraphView, y: fx.Node) -> str | None:
    """The module of a norm that reads ``y`` alone, inside ``y``'s layer (classic post-LN)."""
    layer = view.module_path(y)
    node = y
    for _ in range(4):
        users = view.tensor_users(node)
        if len(users) == 1 and (users[0].target in VIEW_LIKE or view.keeps_rows(users[0])):
            node = users[0]
            continue
        if len(users) == 1 and users[0].target in _FUSED_NORMS:
            norm = users[0]
        elif len(users) > 1 and (found := _written_norm(view, node)) is not None:
            norm = found[1]
        else:
            return None
        module = view.module_path(norm)
        return module if layer and module.startswith(layer + ".") else None
    return None


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


def _common_module(paths: Iterable[str]) -> str:
    """The innermost module holding every path: their longest common dotted prefix."""
    paths = list(paths)
    if not paths:
        return ""
    split = [p.split(".") for p in paths]
    common = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _path_key(path: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in path.split("."))
