"""Solver: compute every block's patch in one reduced pass over the query (MATH.md 3).

The reduced pass interprets the traced graph on the query ids. When it reaches a block's MLP
input it computes the input move from the recorded target and puts the patched weights in place
of the originals before the inner linears run; at the outer linear's input (and at the post
norm's normalised output) it computes the output move from the state actually reached. So each
block's patch is baked, in the model's dtype, before the next block's input is computed: the pass
computes exactly what the emitted model computes (MATH.md 8), and errors of lower blocks are
absorbed because every target is the full run's block output (self-correcting).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from ctxc.errors import SolveError
from ctxc.passes.block_map import BlockMap, LinearSite, MlpBlock
from ctxc.passes.graph_view import GraphView
from ctxc.passes.run_graph import FullRun
from ctxc.passes.update_rules import (
    ConditionError,
    input_move,
    linear_output_move,
    right_inverse,
    scale_output_move,
    stable_post_norm_target,
)
from ctxc.patch import Delta
from ctxc.trace import TracedModel

__all__ = ["APPLY_MODES", "UPDATE_RULES", "BlockStats", "Solution", "at_alignment_of", "solve"]

UPDATE_RULES = ("standard", "stable")
# How a delta acts in the reduced pass, as it will in the artefact: "baked" writes W + dW in the
# model's dtype; "lowrank" keeps W and adds the action (x v) u^T to the linear's output, and
# keeps vector deltas (norm scales) in float32 (materialising in bfloat16 rounds a patch away).
APPLY_MODES = ("baked", "lowrank")
_ALIGN = 64  # bytes: the widest SIMD load the CPU BLAS kernels peel for

# The solver runs once per compile, and `ctxc generate` compiles at every token: keep the
# structural queries (graph view, parameter cast chains) per exported graph, not per call.
_VIEWS: weakref.WeakKeyDictionary[fx.GraphModule, GraphView] = weakref.WeakKeyDictionary()
_CHAINS: weakref.WeakKeyDictionary[GraphView, dict[fx.Node, list[fx.Node]]] = (
    weakref.WeakKeyDictionary()
)


def _view_of(traced: TracedModel) -> GraphView:
    view = _VIEWS.get(traced.graph_module)
    if view is None:
        view = _VIEWS[traced.graph_module] = GraphView(traced)
    return view


def _param_chain(view: GraphView, param: fx.Node) -> list[fx.Node]:
    """Nodes computed from ``param`` alone (casts, ``1 + w``), in graph order."""
    chains = _CHAINS.setdefault(view, {})
    if param not in chains:
        chains[param] = sorted(
            (d for d in view.descendants(param) if view.param_only(d)), key=view.index.__getitem__
        )
    return chains[param]


def at_alignment_of(value: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """``value`` copied into memory with the same address modulo 64 bytes as ``base``.

    CPU BLAS kernels sum in an order that depends on the operand's alignment: the same weights
    at another address give other low bits (measured on Gemma 3 270M: a ``gate_proj`` copy at
    0 mod 64 instead of 56 changes ``F.linear`` by 9.5e-7). A patch applied in place keeps the
    parameter's address (and a reload of the emitted folder reproduces it), so the solver must
    compute with the patched weights at that alignment, or post-norm gains of 1e3 amplify the
    difference (MATH.md 8).
    """
    size = value.element_size()
    want = base.data_ptr() % _ALIGN
    buf = torch.empty(value.numel() + _ALIGN // size, dtype=value.dtype, device=value.device)
    shift = ((want - buf.data_ptr() % _ALIGN) % _ALIGN) // size
    out = buf[shift : shift + value.numel()].view(value.shape)
    out.copy_(value)
    return out


@dataclass(frozen=True)
class BlockStats:
    """What the solver did at one block, with the figures of its conditions.

    Attributes:
        path: module path of the block.
        patched: False for blocks below the start layer.
        rule: update rule applied (``standard`` or ``stable``), or ``""``.
        output_control: ``scale`` or ``linear``.
        input_norm: ``||z||`` reached (smallest over positions).
        input_change: ``max |z_C - z|`` before the move.
        min_divisor: smallest ``|f_i|`` the scale move divided by (scale blocks).
        max_scale_change: largest ``|ds_i|`` (scale blocks).
        max_gain: largest ``|s_i + ds_i|`` (scale blocks).
        residual_error: ``max |y - y_C|`` after the patch, in the reduced pass.
        delta_norms: parameter name -> Frobenius norm of its delta.
    """

    path: str
    patched: bool
    rule: str
    output_control: str
    input_norm: float = 0.0
    input_change: float = 0.0
    min_divisor: float = float("nan")
    max_scale_change: float = float("nan")
    max_gain: float = float("nan")
    residual_error: float = 0.0
    delta_norms: dict[str, float] | None = None


@dataclass(frozen=True)
class Solution:
    """The deltas of every patched block, their figures and the patched logits.

    Attributes:
        deltas: parameter name -> :class:`Delta`, in graph order.
        stats: one :class:`BlockStats` per block.
        logits: the reduced pass's logits [k, vocab], float32: what the emitted model gives.
    """

    deltas: dict[str, Delta]
    stats: tuple[BlockStats, ...]
    logits: torch.Tensor


class _ReducedRun(fx.Interpreter):
    """Interprets the graph on the query, patching each block as its nodes are reached."""

    def __init__(self, solver: _Solver) -> None:
        # The reduced run holds k tokens: keeping every value costs little, and skipping the
        # last-use analysis saves ~0.1 s a call (ctxc generate solves at every token).
        super().__init__(solver.traced.graph_module, garbage_collect_values=False)
        self.solver = solver

    def run_node(self, n: fx.Node):
        if n.target == torch.ops.aten._assert_tensor_metadata.default:
            # Export-time dtype guards: the lowrank mode keeps patched norm scales in float32
            # on purpose, and the graph reads them through a float32 cast anyway.
            return None
        out = super().run_node(n)
        action = self.solver.lowrank.get(n.name)
        if action is not None:
            x = self.env[action[0]].float()  # [1, k, in]
            u, v = action[1]
            out = out + ((x @ v) @ u.T).to(out.dtype)  # [1, k, out]
        hook = self.solver.hooks.get(n.name)
        if hook is not None:
            # The node's value is in env only after run_node returns; put it there for the hook.
            self.env[n] = out
            hook(self, n, out)
        return out

    def replace_param(self, param: fx.Node, value: torch.Tensor) -> None:
        """Make later nodes read ``value`` for ``param``, refreshing casts already computed."""
        self.env[param] = value
        for d in self.solver.chains[param]:
            if d in self.env:
                args, kwargs = self.fetch_args_kwargs_from_env(d)
                self.env[d] = getattr(self, d.op)(d.target, args, kwargs)


class _Solver:
    def __init__(
        self,
        traced: TracedModel,
        blocks: BlockMap,
        full: FullRun,
        k: int,
        update: str,
        start_layer: int,
        on_block: Callable[[int, int, str], None] | None,
        apply: str = "baked",
    ) -> None:
        self.traced, self.full, self.k, self.update = traced, full, k, update
        self.apply = apply
        self.lowrank: dict[str, tuple[fx.Node, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.site_of = {s.weight: s for b in blocks.blocks for s in (*b.inner, b.outer)}
        self.view = _view_of(traced)
        self.on_block = on_block
        self.param_node = {name: self.view.by_name[p] for p, name in traced.param_of.items()}
        self.chains: dict[fx.Node, list[fx.Node]] = {}
        self.hooks: dict[str, Callable] = {}
        self.deltas: dict[str, Delta] = {}
        self.stats: dict[str, dict] = {}
        self.order = [b.path for b in blocks.blocks]
        for i, block in enumerate(blocks.blocks):
            patched = i >= start_layer
            self.stats[block.path] = {
                "path": block.path,
                "patched": patched,
                "rule": update if patched else "",
                "output_control": block.output_control,
            }
            self.hooks[block.residual_add] = self._finish_hook(block, i, len(blocks.blocks))
            if not patched:
                continue
            if block.output_control == "scale" and k > 1:
                raise SolveError(
                    block.path,
                    f"a post-norm scale can match one query position, not {k}: use a "
                    "single-token query for this model",
                )
            self._add_hook(block.mlp_in, self._input_hook(block), block.inner)
            if block.output_control == "linear" or update == "stable":
                self._add_hook(block.activation, self._outer_hook(block), (block.outer,))
            if block.output_control == "scale":
                assert block.scale is not None
                self._add_hook(block.scale.normalized, self._scale_hook(block), ())
                self._watch_param(self.param_node[block.scale.param], block.scale.normalized)

    # -- setup -------------------------------------------------------------------------------

    def _add_hook(self, node: str, hook: Callable, sites: tuple[LinearSite, ...]) -> None:
        if node in self.hooks:
            previous = self.hooks[node]

            def both(run, n, out, _a=previous, _b=hook):
                _a(run, n, out)
                _b(run, n, out)

            self.hooks[node] = both
        else:
            self.hooks[node] = hook
        for site in sites:
            self._watch_param(self.param_node[site.weight], node)

    def _watch_param(self, param: fx.Node, hook_node: str) -> None:
        """Check the graph reads ``param`` only after ``hook_node`` (else a patch comes late)."""
        view = self.view
        chain = _param_chain(view, param)
        self.chains[param] = chain
        readers = [u for d in [param, *chain] for u in d.users if u in view.input_dependent]
        at = view.index[view.by_name[hook_node]]
        early = [u for u in readers if view.index[u] <= at]
        if early:
            raise RuntimeError(
                f"graph reads {self.traced.param_of[param.name]} at {early[0].name} before "
                f"{hook_node} is computed: the solver cannot patch it in time"
            )

    # -- hooks -------------------------------------------------------------------------------

    def _targets(self, block: MlpBlock):
        return self.full.targets[block.path]

    def _wanted_branch(self, run: _ReducedRun, block: MlpBlock) -> torch.Tensor:
        """``(y_C - v) / gain`` [k, d]: what the output-controllable part must produce."""
        v = run.env[self.view.by_name[block.residual_in]][0].float()  # [k, d]
        return (self._targets(block).y.float() - v) / block.gain

    def _put(self, run: _ReducedRun, delta: Delta) -> None:
        node = self.param_node[delta.param]
        base = run.env[node]
        self.deltas[delta.param] = delta
        if self.apply == "lowrank":
            if delta.vector is not None:  # norm scales are read through a float32 cast
                run.replace_param(node, base.float() + delta.vector)
            else:
                site = self.site_of[delta.param]
                assert delta.u is not None and delta.v is not None
                self.lowrank[site.node] = (self.view.by_name[site.input], (delta.u, delta.v))
            return
        run.replace_param(node, at_alignment_of(delta.materialize(base), base))

    def _weight(self, run: _ReducedRun, site: LinearSite) -> torch.Tensor:
        w = run.env[self.param_node[site.weight]]
        return w.T if site.layout == "in_out" else w  # [out, in]

    def _input_hook(self, block: MlpBlock) -> Callable:
        def hook(run: _ReducedRun, node: fx.Node, z: torch.Tensor) -> None:
            z = z[0]  # [k, d_in]
            z_target = self._targets(block).z  # [k, d_in]
            stats = self.stats[block.path]
            stats["input_norm"] = float(z.float().norm(dim=-1).min())
            stats["input_change"] = float((z_target.float() - z.float()).abs().max())
            try:
                z_pinv = right_inverse(z, "MLP input z")  # [d_in, k]
            except ConditionError as exc:
                raise SolveError(block.path, str(exc)) from exc
            for site in block.inner:
                u, v = input_move(self._weight(run, site), z, z_target, z_pinv)
                self._put(run, Delta(site.weight, block.path, u=u, v=v, layout=site.layout))

        return hook

    def _outer_hook(self, block: MlpBlock) -> Callable:
        def hook(run: _ReducedRun, node: fx.Node, h: torch.Tensor) -> None:
            h = h[0]  # [k, d_ff]
            site = block.outer
            w = self._weight(run, site).float()  # [d, d_ff]
            u_now = h.float() @ w.T  # [k, d]
            if site.bias is not None:
                u_now = u_now + run.env[self.param_node[site.bias]].float()
            wanted = self._wanted_branch(run, block)  # [k, d]
            if block.output_control == "linear":
                residual = wanted - u_now  # [k, d]
            else:  # stable rule: move u towards the unit-RMS target, the scale does the rest
                s = self._scale(run, block)  # [d]
                residual = stable_post_norm_target(s, wanted[0], u_now[0])[None] - u_now
            try:
                h_pinv = right_inverse(h, "MLP activation h")  # [d_ff, k]
            except ConditionError as exc:
                raise SolveError(block.path, str(exc)) from exc
            u, v = linear_output_move(residual, h, h_pinv)
            self._put(run, Delta(site.weight, block.path, u=u, v=v, layout=site.layout))

        return hook

    def _scale(self, run: _ReducedRun, block: MlpBlock) -> torch.Tensor:
        sc = block.scale
        assert sc is not None
        w = run.env[self.param_node[sc.param]].float()  # [d]
        return sc.alpha * w + sc.offset

    def _scale_hook(self, block: MlpBlock) -> Callable:
        def hook(run: _ReducedRun, node: fx.Node, f: torch.Tensor) -> None:
            sc = block.scale
            assert sc is not None
            wanted = self._wanted_branch(run, block)[0]  # [d]
            y = self._targets(block).y[0]  # [d], model dtype
            # The block output is rounded to the model's dtype: a change below its spacing at
            # y_C cannot show, so a zero f_i is only an error where more is needed.
            tol = torch.finfo(y.dtype).eps * y.float().abs() / abs(block.gain)  # [d]
            try:
                move = scale_output_move(self._scale(run, block), f[0, 0], wanted, tol)
            except ConditionError as exc:
                raise SolveError(block.path, str(exc)) from exc
            stats = self.stats[block.path]
            stats.update(
                min_divisor=move.min_divisor,
                max_scale_change=move.max_change,
                max_gain=move.max_gain,
            )
            self._put(run, Delta(sc.param, block.path, vector=move.ds / sc.alpha))

        return hook

    def _finish_hook(self, block: MlpBlock, i: int, n: int) -> Callable:
        def hook(run: _ReducedRun, node: fx.Node, y: torch.Tensor) -> None:
            err = (y[0].float() - self._targets(block).y.float()).abs().max()
            self.stats[block.path]["residual_error"] = float(err)
            if self.on_block is not None:
                self.on_block(i + 1, n, block.path)

        return hook

    def run(self, query_ids: torch.Tensor) -> Solution:
        run = _ReducedRun(self)
        with torch.no_grad():
            out = run.run(*self.traced.placeholder_values(query_ids))
        logits = (out[0] if isinstance(out, tuple | list) else out)[0].float()  # [k, vocab]
        stats = []
        for path in self.order:
            s = self.stats[path]
            s["delta_norms"] = {p: d.norm() for p, d in self.deltas.items() if d.block == path}
            stats.append(BlockStats(**s))
        return Solution(deltas=dict(self.deltas), stats=tuple(stats), logits=logits)


def solve(
    traced: TracedModel,
    blocks: BlockMap,
    full: FullRun,
    query_ids: torch.Tensor,
    update: str = "stable",
    start_layer: int = 0,
    on_block: Callable[[int, int, str], None] | None = None,
    apply: str = "baked",
) -> Solution:
    """Compute every block's patch in one reduced pass (pure: the model is not modified).

    Args:
        traced: the exported model.
        blocks: the located blocks, in graph order.
        full: the full run's targets (:func:`record_targets`).
        query_ids: int64 [1, k], the query alone.
        update: ``standard`` (Theorem 1) or ``stable`` (MATH.md 4, for scaled post norms).
        start_layer: blocks with index below it stay unpatched (ablation C.4).
        on_block: progress callback ``(done, total, path)``.
        apply: ``baked`` (W + dW in the model's dtype, as the torch backend emits) or
            ``lowrank`` (the action ``(x v) u^T`` beside W; vector deltas kept in float32).

    Returns:
        the :class:`Solution`.

    Raises:
        SolveError: a block's condition fails (zero norm, zero divisor), with its value.
    """
    if update not in UPDATE_RULES:
        raise ValueError(f"unknown update rule {update!r}; expected one of {UPDATE_RULES}")
    k = int(query_ids.shape[1])
    if apply not in APPLY_MODES:
        raise ValueError(f"unknown apply mode {apply!r}; expected one of {APPLY_MODES}")
    solver = _Solver(traced, blocks, full, k, update, start_layer, on_block, apply)
    return solver.run(query_ids)
