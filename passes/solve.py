"""Solver: compute every block's patch in one reduced pass over the query (MATH.md 3).

The reduced pass interprets the traced graph on the query ids. When it reaches a block's MLP
input it computes the input move from the recorded target and puts the patched weights in place
of the originals before the inner linears run (the expert banks of an MoE: once the router has
chosen the experts). At the block output ``y`` it computes the output move from the state
actually reached: the tail ops between the output-controlled value and ``y`` (casts, constant
gains, the attention output of a parallel block, a shared expert, a gate) are inverted to turn
the target ``y_C`` into the value that part must produce; the patched parameter is put in place
and the nodes already computed from it are computed again, so ``y`` is what the patched model
gives. Each block's patch is thus baked, in the model's dtype, before the next block's input is
computed: the pass computes exactly what the emitted model computes (MATH.md 8), and errors of
lower blocks are absorbed because every target is the full run's block output (self-correcting).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from ctxc.errors import SolveError
from ctxc.passes.block_map import BlockMap, LinearSite, MlpBlock
from ctxc.passes.graph_view import GraphView
from ctxc.passes.multi_scale import fit_shared_scale, multi_refusal, shared_scale_targets
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

__all__ = ["UPDATE_RULES", "BlockStats", "Solution", "at_alignment_of", "solve"]

# standard: the paper's rule (input move, then output move); stable: MATH.md 4 for scaled post
# norms; output: no input move, the outer function absorbs the whole difference.
UPDATE_RULES = ("standard", "stable", "output")
_ALIGN = 64  # bytes: the widest SIMD load the CPU BLAS kernels peel for


_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
# `ctxc generate` solves at every token: keep the graph's structural queries per exported graph.
_VIEWS: weakref.WeakKeyDictionary[fx.GraphModule, GraphView] = weakref.WeakKeyDictionary()


def _view_of(traced: TracedModel) -> GraphView:
    view = _VIEWS.get(traced.graph_module)
    if view is None:
        view = _VIEWS[traced.graph_module] = GraphView(traced)
    return view


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
        patched: False for blocks below the start layer, or left unpatched (``rejected``).
        rule: update rule applied (``standard``, ``stable`` or ``output``), or ``""``.
        output_control: ``linear``, ``scale``, ``bias`` or ``experts``.
        input_norm: ``||z||`` reached (smallest over positions).
        input_change: ``max |z_C - z|`` before the move.
        min_divisor: smallest ``|f_i|`` the scale move divided by (scale blocks).
        max_scale_change: largest ``|ds_i|`` (scale blocks).
        max_gain: largest ``|s_i + ds_i|`` (scale blocks).
        residual_error: ``max |y - y_C|`` after the patch, in the reduced pass.
        unreached: coordinates a low-precision zero ``f_i`` left unreached (scale blocks).
        max_unreached: the largest change such a coordinate missed.
        delta_norms: parameter name -> Frobenius norm of its delta.
        min_gate_sum: smallest gate sum ``S`` the experts' output move divided by (MoE).
        rejected: why the block was left unpatched (a failed condition), or ``""``.
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
    unreached: int = 0
    max_unreached: float = 0.0
    delta_norms: dict[str, float] | None = None
    min_gate_sum: float = float("nan")
    rejected: str = ""


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


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Positions as rows: [1, k, d] or [k, d] -> [k, d] (a view)."""
    return x.reshape(-1, x.shape[-1])


class _ReducedRun(fx.Interpreter):
    """Interprets the graph on the query, patching each block as its nodes are reached.

    Values are kept (no garbage collection: the query is a few tokens) so that a patch put in
    place at the block output can recompute the nodes that already read the old weight.
    """

    def __init__(self, solver: _Solver) -> None:
        super().__init__(solver.traced.graph_module, garbage_collect_values=False)
        self.solver = solver
        # apply="lowrank": node -> functions adding a delta's action to the node's value.
        self.actions: dict[fx.Node, list[Callable[[torch.Tensor], torch.Tensor]]] = {}

    def run_node(self, n: fx.Node):
        if n.target is _ASSERT_METADATA:
            return None  # an export-time guard of a weight's dtype; nothing to compute
        # Interpreter.run_node without its error-context manager: this loop runs at every
        # generated token of `ctxc generate`, where the per-node overhead shows.
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        out = getattr(self, n.op)(n.target, args, kwargs)
        for act in self.actions.get(n, ()):
            out = act(out)
        if n.name in self.solver.capture:
            self.solver.captured[n.name] = out.detach().clone()
        hooks = self.solver.hooks.get(n.name)
        if hooks:
            # The node's value is in env only after run_node returns; put it there for the hook.
            self.env[n] = out
            for hook in hooks:
                hook(self, n, out)
            out = self.env[n]  # a hook may have recomputed it with patched weights
        return out

    def replace_param(self, param: fx.Node, value: torch.Tensor, upto: fx.Node) -> None:
        """Make ``param`` read ``value``, recomputing the nodes up to ``upto`` that used it."""
        self.env[param] = value
        self.recompute_from(param, upto)

    def add_action(
        self, node: fx.Node, act: Callable[[torch.Tensor], torch.Tensor], upto: fx.Node
    ) -> None:
        """Add ``act`` to ``node``'s value from now on; if it is computed, recompute after it."""
        self.actions.setdefault(node, []).append(act)
        if node in self.env:
            # Compute the node afresh: a later in-place op may have changed the stored value
            # (Falcon adds the attention output into the MLP output with add_).
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            value = getattr(self, node.op)(node.target, args, kwargs)
            for a in self.actions[node]:
                value = a(value)
            self.env[node] = value
            if node.name in self.solver.capture:
                self.solver.captured[node.name] = value.detach().clone()
            self.recompute_from(node, upto)

    def recompute_from(self, root: fx.Node, upto: fx.Node) -> None:
        """Compute again, in graph order, every node up to ``upto`` that depends on ``root``."""
        done = {root}
        for d in self.solver.dependents(root, upto):
            if d not in self.env:
                continue
            schema = getattr(d.target, "_schema", None)
            if schema is not None and schema.is_mutable and d.args[0] not in done:
                raise RuntimeError(
                    f"cannot recompute the in-place op {d.target} on a value the patch does "
                    "not change"
                )
            args, kwargs = self.fetch_args_kwargs_from_env(d)
            value = getattr(self, d.op)(d.target, args, kwargs)
            for act in self.actions.get(d, ()):
                value = act(value)
            self.env[d] = value
            done.add(d)
            if d.name in self.solver.capture:
                self.solver.captured[d.name] = self.env[d].detach().clone()


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
        skip: Mapping[str, str],
        apply: str = "baked",
    ) -> None:
        self.traced, self.full, self.k, self.update = traced, full, k, update
        self.apply = apply
        self.view = _view_of(traced)
        self.on_block = on_block
        self.param_node = {name: self.view.by_name[p] for p, name in traced.param_of.items()}
        self.hooks: dict[str, list[Callable]] = {}
        self.capture: set[str] = set()
        self.captured: dict[str, torch.Tensor] = {}
        self.z_reached: dict[str, torch.Tensor] = {}
        self._dependents: dict[tuple[fx.Node, fx.Node], list[fx.Node]] = {}
        self.deltas: dict[str, Delta] = {}
        self.stats: dict[str, dict] = {}
        self.order = [b.path for b in blocks.blocks]
        n = len(blocks.blocks)
        for i, block in enumerate(blocks.blocks):
            patched = i >= start_layer and block.path not in skip
            self.stats[block.path] = {
                "path": block.path,
                "patched": patched,
                "rule": update if patched else "",
                "output_control": block.output_control,
                "rejected": skip.get(block.path, ""),
            }
            if not patched:
                self._add_hook(block.residual_add, self._finish_hook(block, i, n))
                continue
            if k > 1 and (reason := multi_refusal(block, k)):
                raise SolveError(block.path, reason)
            self._setup_block(block, i, n)

    # -- setup -------------------------------------------------------------------------------

    def _setup_block(self, block: MlpBlock, i: int, n: int) -> None:
        move_inputs = self.update != "output"
        self._add_hook(block.mlp_in, self._input_hook(block, move_inputs))
        if move_inputs:
            banks: dict[str, list[LinearSite]] = {}
            for site in block.inner:
                if site.experts:
                    banks.setdefault(site.experts, []).append(site)
                    self._watch(block, site.weight, site.experts)
                else:
                    self._watch(block, site.weight, block.mlp_in)
            for ids, sites in banks.items():
                self._add_hook(ids, self._bank_input_hook(block, tuple(sites)))
        for param in self._output_params(block):
            self._watch(block, param, block.mlp_in)
        self._add_hook(block.residual_add, self._output_hook(block, i, n))
        # Values the output move reads at y, kept as computed (later in-place ops may change
        # them: Falcon adds the attention output into the MLP output with add_).
        self.capture.update({block.activation, block.control})
        self.capture.update(s.side for s in block.tail if s.side is not None)
        if block.norm is not None:
            self.capture.add(block.norm.input)
            if block.scale is not None and block.scale.normalized:
                self.capture.add(block.scale.normalized)
        if block.experts is not None:
            self.capture.update({block.experts.gate, block.experts.combine})
            assert block.outer.experts is not None
            self.capture.add(block.outer.experts)

    def _output_params(self, block: MlpBlock) -> list[str]:
        ctl = block.output_control
        if ctl == "scale":
            assert block.scale is not None
            # k > 1: every rule moves the down projection (multi_scale.py).
            stable = (self.update in ("stable", "output") or self.k > 1) and block.stable_ok
            return [block.outer.weight, block.scale.param] if stable else [block.scale.param]
        if ctl == "bias":
            assert block.norm is not None and block.norm.bias is not None
            return [block.norm.bias]
        return [block.outer.weight]

    def _add_hook(self, node: str, hook: Callable) -> None:
        self.hooks.setdefault(node, []).append(hook)

    def _watch(self, block: MlpBlock, param: str, hook_node: str) -> None:
        """Check the graph reads ``param`` only after ``hook_node`` (else a patch comes late)."""
        view = self.view
        node = self.param_node[param]
        chain, stack = [], [node]  # the weight's casts and transposes, then their readers
        while stack:
            for u in stack.pop().users:
                if u not in view.input_dependent and u not in chain:
                    chain.append(u)
                    stack.append(u)
        readers = [u for d in [node, *chain] for u in d.users if u in view.input_dependent]
        at = view.index[view.by_name[hook_node]]
        early = sorted((u for u in readers if view.index[u] <= at), key=view.index.__getitem__)
        if early:
            raise SolveError(
                block.path,
                f"the graph reads {param} (at {view.module_path(early[0]) or 'the model'}) "
                "before the block computes its patch: the solver cannot patch it in time",
            )

    def dependents(self, param: fx.Node, upto: fx.Node) -> list[fx.Node]:
        key = (param, upto)
        if key not in self._dependents:
            self._dependents[key] = self.view.descendants_upto(param, self.view.index[upto])
        return self._dependents[key]

    # -- helpers -----------------------------------------------------------------------------

    def _targets(self, block: MlpBlock):
        return self.full.targets[block.path]

    def _value(self, run: _ReducedRun, name: str) -> torch.Tensor:
        if name in self.captured:
            return self.captured[name]
        return run.env[self.view.by_name[name]]

    def _put(
        self,
        run: _ReducedRun,
        delta: Delta,
        upto: fx.Node,
        at: LinearSite | MlpBlock | None = None,
    ) -> None:
        """Put ``delta`` in place: baked into the weight, or (``lowrank``) as an action on the
        output of ``at`` (a linear site, or the block whose scale or bias it changes)."""
        node = self.param_node[delta.param]
        if delta.param in self.deltas and self.deltas[delta.param].block != delta.block:
            raise SolveError(
                delta.block,
                f"{delta.param} is shared with block {self.deltas[delta.param].block}: one "
                "parameter cannot take two blocks' patches",
            )
        self.deltas[delta.param] = delta
        if self.apply == "lowrank" and at is not None:
            target, act = self._action(run, delta, at)
            run.add_action(self.view.by_name[target], act, upto)
            return
        base = run.env[node]
        run.replace_param(node, at_alignment_of(delta.materialize(base), base), upto)

    def _action(
        self, run: _ReducedRun, delta: Delta, at: LinearSite | MlpBlock
    ) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """The node a delta acts on and the action, computed in float32 beside the weights."""
        if isinstance(at, LinearSite):
            x_node = self.view.by_name[at.input]
            u, v = delta.u, delta.v
            assert u is not None and v is not None
            if delta.experts:
                ids_node = self.view.by_name[at.experts or ""]
                slot = {e: i for i, e in enumerate(delta.experts)}

                def bank_act(out: torch.Tensor) -> torch.Tensor:
                    x = _rows(run.env[x_node]).float()  # [rows, in]
                    ids = run.env[ids_node].reshape(-1).tolist()
                    add = torch.zeros(out.shape, dtype=torch.float32)  # [rows, out]
                    for r, e in enumerate(ids):
                        if e in slot:
                            add[r] = (x[r] @ v[slot[e]]) @ u[slot[e]].T  # [out]
                    return (out.float() + add).to(out.dtype)

                return at.node, bank_act

            def linear_act(out: torch.Tensor) -> torch.Tensor:
                x = _rows(run.env[x_node]).float()  # [k, in]
                add = (x @ v) @ u.T  # [k, out]
                return (out.float() + add.reshape(out.shape)).to(out.dtype)

            return at.node, linear_act
        assert delta.vector is not None
        vec = delta.vector
        if at.output_control == "bias":
            assert at.norm is not None and at.norm.bias_node is not None
            return at.norm.bias_node, lambda out: (out.float() + vec).to(out.dtype)
        sc = at.scale
        assert sc is not None

        def scale_act(out: torch.Tensor) -> torch.Tensor:
            f = self._normalized(run, at).float().reshape(out.shape)
            return (out.float() + f * (sc.alpha * vec)).to(out.dtype)

        return sc.node, scale_act

    def _weight(self, run: _ReducedRun, site: LinearSite) -> torch.Tensor:
        w = run.env[self.param_node[site.weight]]
        return w.T if site.layout == "in_out" else w  # [out, in]

    def _scale(self, run: _ReducedRun, block: MlpBlock) -> torch.Tensor:
        sc = block.scale
        assert sc is not None
        w = run.env[self.param_node[sc.param]].float()  # [d]
        return sc.alpha * w + sc.offset

    def _control_target(self, run: _ReducedRun, block: MlpBlock) -> torch.Tensor:
        """The value [k, d] the output-controlled part must take so that ``y = y_C``."""
        t = self._targets(block).y.float()  # [k, d]
        for step in reversed(block.tail):
            if step.kind == "add":
                assert step.side is not None
                t = t - _rows(self._value(run, step.side)).float()  # [k, d]
            elif step.kind == "gain":
                t = t / step.factor
            elif step.kind == "gate":
                assert step.side is not None
                g = _rows(self._value(run, step.side)).float()  # [k, 1]
                if bool((g == 0).any()):
                    raise ConditionError(
                        f"the branch gate is 0 at {int((g == 0).sum())} query position(s): "
                        "nothing behind it reaches the output"
                    )
                t = t / g
        return t

    def _outer_now(self, run: _ReducedRun, block: MlpBlock, h: torch.Tensor) -> torch.Tensor:
        """The outer linear's output [k, d] in float32, from its input ``h`` [k, d_ff]."""
        site = block.outer
        u_now = h.float() @ self._weight(run, site).float().T  # [k, d]
        if site.bias is not None:
            u_now = u_now + run.env[self.param_node[site.bias]].float()
        return u_now

    def _linear_delta(
        self, run: _ReducedRun, block: MlpBlock, residual: torch.Tensor, h: torch.Tensor, upto
    ) -> None:
        h_pinv = right_inverse(h, "MLP activation h")  # [d_ff, k]
        u, v = linear_output_move(residual, h, h_pinv)
        site = block.outer
        delta = Delta(site.weight, block.path, u=u, v=v, layout=site.layout)
        self._put(run, delta, upto, at=site)

    def _normalized(self, run: _ReducedRun, block: MlpBlock) -> torch.Tensor:
        """The normalised MLP output ``f`` [k, d] the scale multiplies, as now computed."""
        norm, sc = block.norm, block.scale
        assert norm is not None and sc is not None
        if sc.normalized:
            return _rows(self._value(run, sc.normalized))
        x = _rows(self._value(run, norm.input)).float()  # [k, d]: a fused norm's input
        eps = norm.eps if norm.eps is not None else 1e-5
        if norm.centered:
            return F.layer_norm(x, (x.shape[-1],), None, None, eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps)

    # -- hooks -------------------------------------------------------------------------------

    def _input_hook(self, block: MlpBlock, move: bool) -> Callable:
        def hook(run: _ReducedRun, node: fx.Node, z: torch.Tensor) -> None:
            z = _rows(z)  # [k, d_in]
            z_target = self._targets(block).z  # [k, d_in]
            self.z_reached[block.path] = z.detach().clone()
            stats = self.stats[block.path]
            stats["input_norm"] = float(z.float().norm(dim=-1).min())
            stats["input_change"] = float((z_target.float() - z.float()).abs().max())
            if not move:
                return
            try:
                z_pinv = right_inverse(z, "MLP input z")  # [d_in, k]
            except ConditionError as exc:
                raise SolveError(block.path, str(exc)) from exc
            for site in block.inner:
                if site.experts:
                    continue  # moved once the router has chosen the experts
                u, v = input_move(self._weight(run, site), z, z_target, z_pinv)
                delta = Delta(site.weight, block.path, u=u, v=v, layout=site.layout)
                self._put(run, delta, node, at=site)

        return hook

    def _bank_input_hook(self, block: MlpBlock, sites: tuple[LinearSite, ...]) -> Callable:
        """Input move of every active expert of the banks that read ``z`` (MATH.md 2, MoE)."""

        def hook(run: _ReducedRun, node: fx.Node, ids: torch.Tensor) -> None:
            ids = ids.reshape(-1).long()  # [rows]: expert of each bank row
            z = self.z_reached[block.path]  # [k, d_in]
            z_target = self._targets(block).z  # [k, d_in]
            for site in sites:
                bank = run.env[self.param_node[site.weight]]  # [E, ., .]
                us, vs, experts = [], [], []
                for e in sorted(set(ids.tolist())):
                    tokens = torch.unique((ids == e).nonzero().flatten() // site.repeat)
                    ze = z[tokens]  # [n_e, d_in]
                    try:
                        pinv = right_inverse(ze, f"MLP input z of expert {e}")  # [d_in, n_e]
                    except ConditionError as exc:
                        raise SolveError(block.path, str(exc)) from exc
                    w = bank[e].T if site.layout == "in_out" else bank[e]  # [out, in]
                    u, v = input_move(w, ze, z_target[tokens], pinv)
                    us.append(u)
                    vs.append(v)
                    experts.append(e)
                delta = _bank_delta(site, block.path, us, vs, experts)
                self._put(run, delta, node, at=site)

        return hook

    def _output_hook(self, block: MlpBlock, i: int, n: int) -> Callable:
        def hook(run: _ReducedRun, node: fx.Node, y: torch.Tensor) -> None:
            try:
                self._output_move(run, block, node)
            except ConditionError as exc:
                raise SolveError(block.path, str(exc)) from exc
            self._finish(run, block, node, i, n)

        return hook

    def _finish_hook(self, block: MlpBlock, i: int, n: int) -> Callable:
        def hook(run: _ReducedRun, node: fx.Node, y: torch.Tensor) -> None:
            self._finish(run, block, node, i, n)

        return hook

    def _finish(self, run: _ReducedRun, block: MlpBlock, node: fx.Node, i: int, n: int) -> None:
        y = _rows(run.env[node]).float()  # [k, d]
        err = (y - self._targets(block).y.float()).abs().max()
        self.stats[block.path]["residual_error"] = float(err)
        if self.on_block is not None:
            self.on_block(i + 1, n, block.path)

    # -- output moves ------------------------------------------------------------------------

    def _output_move(self, run: _ReducedRun, block: MlpBlock, y: fx.Node) -> None:
        t = self._control_target(run, block)  # [k, d]: wanted value of the controlled part
        ctl = block.output_control
        if ctl == "linear":
            h = _rows(self._value(run, block.activation))  # [k, d_ff]
            self._linear_delta(run, block, t - self._outer_now(run, block, h), h, y)
        elif ctl == "scale":
            self._scale_move(run, block, t, y)
        elif ctl == "bias":
            assert block.norm is not None and block.norm.bias is not None
            now = _rows(self._value(run, block.control)).float()  # [1, d]
            db = t[0] - now[0]  # [d]: a bias adds any vector, no condition (MATH.md 1)
            self._put(run, Delta(block.norm.bias, block.path, vector=db), y, at=block)
        elif ctl == "experts":
            self._experts_move(run, block, t, y)
        else:  # pragma: no cover - the locator only makes the kinds above
            raise SolveError(block.path, f"unknown output control {ctl!r}")

    def _scale_move(self, run: _ReducedRun, block: MlpBlock, t: torch.Tensor, y) -> None:
        sc = block.scale
        assert sc is not None
        if t.shape[0] > 1:
            self._shared_scale_move(run, block, t, y)
            return
        if self.update in ("stable", "output") and block.stable_ok:
            # Stable rule: move u towards the unit-RMS target, the scale does the rest (MATH.md 4).
            h = _rows(self._value(run, block.activation))  # [k, d_ff]
            u_now = self._outer_now(run, block, h)  # [k, d]
            s = self._scale(run, block)  # [d]
            residual = stable_post_norm_target(s, t[0], u_now[0])[None] - u_now  # [1, d]
            self._linear_delta(run, block, residual, h, y)
        # The scale change from the output the patched MLP actually produces (MATH.md 8).
        f = self._normalized(run, block)  # [1, d]
        y_target = self._targets(block).y[0]  # [d], model dtype
        # The block output is rounded to the model's dtype: a change below its spacing at y_C
        # cannot show. In low precision a zero f_i is rounding (the patched u_i cancelled to
        # 0): leave that coordinate, count the miss, and let the next block absorb it.
        tol = torch.finfo(y_target.dtype).eps * y_target.float().abs()  # [d]
        low = y_target.dtype != torch.float32
        move = scale_output_move(self._scale(run, block), f[0], t[0], tol, allow_unreached=low)
        self.stats[block.path].update(
            min_divisor=move.min_divisor,
            max_scale_change=move.max_change,
            max_gain=move.max_gain,
            unreached=move.unreached,
            max_unreached=move.max_unreached,
        )
        self._put(run, Delta(sc.param, block.path, vector=move.ds / sc.alpha), y, at=block)

    def _shared_scale_move(self, run: _ReducedRun, block: MlpBlock, t: torch.Tensor, y) -> None:
        """k query positions, one scale: the down projection sets each position's normalised
        output ``t_j / s'``, then ``s'`` is fitted to what the patched MLP produces."""
        sc = block.scale
        assert sc is not None
        h = _rows(self._value(run, block.activation))  # [k, d_ff]
        u_now = self._outer_now(run, block, h)  # [k, d]
        rho = self._normalized(run, block).double().pow(2).mean(dim=1)  # [k]: M / (M + eps)
        shared = shared_scale_targets(self._scale(run, block), t, u_now, rho)
        self._linear_delta(run, block, shared.targets - u_now, h, y)  # [k, d] residual
        f = self._normalized(run, block)  # [k, d], recomputed (MATH.md 8)
        y_target = self._targets(block).y  # [k, d], model dtype
        tol = (torch.finfo(y_target.dtype).eps * y_target.float().abs()).amax(dim=0)  # [d]
        low = y_target.dtype != torch.float32
        fit = fit_shared_scale(self._scale(run, block), f, t, tol, allow_unreached=low)
        self.stats[block.path].update(
            min_divisor=fit.min_divisor,
            max_scale_change=fit.max_change,
            max_gain=fit.max_gain,
            unreached=fit.unreached,
            max_unreached=fit.max_unreached,
        )
        self._put(run, Delta(sc.param, block.path, vector=fit.ds / sc.alpha), y, at=block)

    def _experts_move(self, run: _ReducedRun, block: MlpBlock, t: torch.Tensor, y) -> None:
        """Every active expert's output map takes ``d / S`` (MATH.md 1, MoE)."""
        ex, site = block.experts, block.outer
        assert ex is not None and site.experts is not None
        now = _rows(self._value(run, ex.combine)).float()  # [k, d]
        d = t - now  # [k, d]
        ids = self._value(run, site.experts).reshape(-1).long()  # [k * top_k]
        gates = self._value(run, ex.gate).reshape(-1).float()  # [k * top_k]
        h = _rows(self._value(run, site.input)).float()  # [k * top_k, d_ff]
        gate_sum = gates.view(-1, ex.top_k).sum(dim=1)  # [k]
        self.stats[block.path]["min_gate_sum"] = float(gate_sum.abs().min())
        if bool((gate_sum == 0).any()):
            i = int((gate_sum == 0).nonzero()[0])
            raise ConditionError(
                f"gate sum S = 0 at query position {i} (routing weights "
                f"{gates.view(-1, ex.top_k)[i].tolist()}): the experts' output move divides by it"
            )
        us, vs, experts = [], [], []
        for e in sorted(set(ids.tolist())):
            rows = (ids == e).nonzero().flatten()  # bank rows routed to e
            tokens = rows // ex.top_k
            wanted = d[tokens] / gate_sum[tokens, None]  # [n_e, d]
            he = h[rows]  # [n_e, d_ff]
            pinv = right_inverse(he, f"activation h of expert {e}")  # [d_ff, n_e]
            u, v = linear_output_move(wanted, he, pinv)
            us.append(u)
            vs.append(v)
            experts.append(e)
        self._put(run, _bank_delta(site, block.path, us, vs, experts), y, at=site)

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


def _bank_delta(
    site: LinearSite,
    block: str,
    us: list[torch.Tensor],
    vs: list[torch.Tensor],
    experts: list[int],
) -> Delta:
    """One delta for the listed experts of a bank, factors zero-padded to a common rank."""
    r = max(u.shape[1] for u in us)
    u = torch.stack([F.pad(x, (0, r - x.shape[1])) for x in us])  # [n, out, r]
    v = torch.stack([F.pad(x, (0, r - x.shape[1])) for x in vs])  # [n, in, r]
    return Delta(site.weight, block, u=u, v=v, layout=site.layout, experts=tuple(experts))


def solve(
    traced: TracedModel,
    blocks: BlockMap,
    full: FullRun,
    query_ids: torch.Tensor,
    update: str = "stable",
    start_layer: int = 0,
    on_block: Callable[[int, int, str], None] | None = None,
    apply: str = "baked",
    skip: Mapping[str, str] | None = None,
) -> Solution:
    """Compute every block's patch in one reduced pass (pure: the model is not modified).

    Args:
        traced: the exported model.
        blocks: the located blocks, in graph order.
        full: the full run's targets (:func:`record_targets`).
        query_ids: int64 [1, k], the query alone.
        update: ``standard`` (Theorem 1), ``stable`` (MATH.md 4, for scaled post norms) or
            ``output`` (no input move: the outer function absorbs the whole difference).
        start_layer: blocks with index below it stay unpatched (ablation C.4).
        on_block: progress callback ``(done, total, path)``.
        apply: ``baked`` (each patch materialised into its weight in the model's dtype, as the
            emitted model holds it) or ``lowrank`` (each delta added as a float32 action on its
            linear's output, beside the unchanged weights: MATH.md 6, bfloat16 rounds a baked
            patch away).
        skip: block path -> reason, for blocks to leave unpatched (a condition they failed).

    Returns:
        the :class:`Solution`.

    Raises:
        SolveError: a block's condition fails (zero norm, zero divisor, gate sum 0), with its
            value.
    """
    if update not in UPDATE_RULES:
        raise ValueError(f"unknown update rule {update!r}; expected one of {UPDATE_RULES}")
    if apply not in ("baked", "lowrank"):
        raise ValueError(f"unknown apply mode {apply!r}; expected baked or lowrank")
    k = int(query_ids.shape[1])
    solver = _Solver(traced, blocks, full, k, update, start_layer, on_block, skip or {}, apply)
    return solver.run(query_ids)
