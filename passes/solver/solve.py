"""Solver: compute every block's patch in one reduced pass over the query (MATH.md 3).

The driver walks the reduced run (:class:`~ctxc.passes.runtime.reduced_run.ReducedRun`) block by
block,
doing what the block's :func:`~ctxc.passes.locate.plan.plan` says. At the MLP input it computes the
input move from the recorded target and puts the patched weights in place before the inner
linears run (the expert banks of an MoE: once the router has chosen the experts). At the block
output ``y`` it computes the output move from the state actually reached: the tail ops between
the output-controlled value and ``y`` are inverted to turn the target ``y_C`` into the value that
part must produce; the patched parameter is put in place and the nodes already computed from it
are computed again, so ``y`` is what the patched model gives. Each patch is baked in the model's
dtype before the next block's input is computed: the pass computes what the emitted model does
(MATH.md 8), and targets are the full run's block outputs: self-correcting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import fx

from ctxc.core.block_stats import BlockStats
from ctxc.core.buffer_pool import BufferPool
from ctxc.core.errors import SolveError
from ctxc.core.vocabulary import DEFAULT_RULE, LORA_RULE, RULES
from ctxc.frontend.trace import TracedModel
from ctxc.passes.locate.block_map import BlockMap, LinearSite, MlpBlock
from ctxc.passes.locate.graph_view import GraphView
from ctxc.passes.locate.plan import BlockPlan, checked_plan
from ctxc.passes.runtime.delta_actions import linear_action, vector_action
from ctxc.passes.runtime.reduced_run import Action, ReducedRun
from ctxc.passes.runtime.run_graph import FullRun
from ctxc.passes.solver import block_moves as moves
from ctxc.passes.solver.output_magnitude import (
    AbsWeights,
    choose_magnitude,
    rounding_gain,
    summed_terms,
)
from ctxc.passes.solver.primitive_moves import ConditionError, ScaleMove, right_inverse
from ctxc.passes.solver.reach_post_norm import reachable_outputs
from ctxc.passes.solver.reach_two_norms import TwoNormReach, two_norm_targets
from ctxc.passes.solver.solver_values import SolverValues, rows
from ctxc.patch import Delta

__all__ = ["RULES", "Solution", "solve"]

aten = torch.ops.aten


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


@dataclass(frozen=True)
class _Output:
    """What a block's output move did: the scale move, the smallest gate sum, the magnitude
    factor and the rounding figure (MATH.md 12); each None where it does not apply."""

    scale: ScaleMove | None = None
    gate_sum: float | None = None
    magnitude: float | None = None
    rounding_gain: float | None = None


class _Solver(SolverValues):
    """Drives one reduced run: each block's moves (:mod:`block_moves`), put in place in turn.

    Mutates only its run and its ``deltas``; the model and the graph are not modified.
    """

    def __init__(
        self,
        traced: TracedModel,
        full: FullRun,
        query_ids: torch.Tensor,
        apply: str,
        keep: set[str],
        stops: frozenset[str],  # node names the run stops at, reads or acts on
        ops: Mapping[str, Callable],  # node name -> what computes it instead of its op
        abs_memo: AbsWeights | None = None,
    ) -> None:
        self.full, self.apply, self.abs_memo = full, apply, abs_memo
        self.view = view = GraphView.of(traced)
        self.param_node, self.deltas = view.param_node, dict[str, Delta]()
        inputs, kept = traced.placeholder_values(query_ids), (view.by_name[n] for n in keep)
        ops_at = {view.by_name[n]: fn for n, fn in ops.items()}
        self.run = ReducedRun(view, kept, inputs, stops, ops_at)
        self.pool = BufferPool()  # the patched weights of the block being solved

    def logits(self) -> torch.Tensor:
        """Finish the run: its logits [k, vocab], float32."""
        out = self.run.finish()
        return (out[0] if isinstance(out, tuple | list) else out)[0].float()

    # -- one block ---------------------------------------------------------------------------

    def skip_block(self, block: MlpBlock, rejected: str) -> BlockStats:
        """Run through a block left unpatched; its figures."""
        y = self.advance_to(block.residual_add)
        return BlockStats(
            block.path,
            False,
            "",
            block.output_control,
            residual_error=self._error(block, y),
            delta_norms={},
            rejected=rejected,
        )

    def patch_block(self, block: MlpBlock, todo: BlockPlan) -> BlockStats:
        """Run through a block, putting its moves in place as its nodes are reached."""
        if todo.attention:
            return self._patch_two_norms(block, todo)
        z_node = self.advance_to(block.mlp_in)
        z = rows(self.run.env[z_node]).detach().clone()  # [k, d_in]
        z_target = self.full.targets[block.path].z  # [k, d_in]
        if todo.moves_inputs:
            sites = [s for s in block.inner if not s.experts]
            recorded = self.full.targets[block.path].inner
            # (an MoE block's router runs between z and the expert banks: the run must stop
            # there first, so its inner outputs are not reached ahead of it)
            if recorded and block.experts is None and all(s.module in recorded for s in sites):
                self._input_moves_from_outputs(sites, z, recorded, block.path)
            else:
                found = moves.input_moves([self.weight(s) for s in sites], z, z_target)
                for site, (u, v) in zip(sites, found, strict=True):
                    delta = Delta(site.weight, block.path, u=u, v=v, layout=site.layout)
                    self._put(delta, z_node, site)
            self._move_banks(block, z, z_target)
        y = self.advance_to(block.residual_add)
        out = self._output_move(block, todo, y)
        scale = out.scale
        return BlockStats(
            block.path,
            True,
            todo.rule,
            block.output_control,
            input_norm=float(z.float().norm(dim=-1).min()),
            input_change=float((z_target.float() - z.float()).abs().max()),
            min_divisor=scale.min_divisor if scale else None,
            max_scale_change=scale.max_change if scale else None,
            max_gain=scale.max_gain if scale else None,
            residual_error=self._error(block, y),
            unreached=scale.unreached if scale else 0,
            max_unreached=scale.max_unreached if scale else 0.0,
            delta_norms={p: d.norm() for p, d in self.deltas.items() if d.block == block.path},
            min_gate_sum=out.gate_sum,
            unreached_norm=self._miss(block, y) if todo.rule == LORA_RULE else None,
            output_magnitude=out.magnitude,
            rounding_gain=out.rounding_gain,
        )

    def _input_moves_from_outputs(
        self,
        sites: list[LinearSite],
        z: torch.Tensor,
        recorded: Mapping[str, torch.Tensor],
        path: str,
    ) -> None:
        """The input moves from the full run's recorded outputs ``W z_C`` (MATH.md 1): the run
        computes each linear's ``W z`` as it goes, and ``u = W z_C - W z`` needs no product
        with the weight (``W (z_C - z)`` reads it again: 17 of a ``ctxc generate`` step's 190
        ms on Gemma 3 270M). The moves are added to the outputs already computed (kept: the
        weights are not read a second time)."""
        z_pinv = right_inverse(z, "MLP input z")  # [in, k], shared by every linear
        last = max(sites, key=lambda s: self.view.index[self.view.by_name[s.node]])
        upto = self.advance_to(last.node)  # every site's W z, computed as the run goes
        for site in sites:
            now = rows(self.value(site.node)).float()  # [k, out]: W z
            u = (recorded[site.module].float() - now).T.contiguous()  # [out, k]
            delta = Delta(site.weight, path, u=u, v=z_pinv.contiguous(), layout=site.layout)
            self._put(delta, upto, site)

    def _patch_two_norms(self, block: MlpBlock, todo: BlockPlan) -> BlockStats:
        """The ``lora`` rule on a sandwich-norm block (MATH.md 10): the attention and the down
        projections set the two normalised outputs whose scaled sum is ``y_C - x``; gate and up
        move ``z`` to ``z_C``.

        Solved twice: first with the MLP's ``rho`` as the reduced run reached it, which puts
        ``v`` near ``v_C`` and so the MLP output near the full run's; then with that output's
        own ``rho``, so the down projection keeps the full run's magnitude (a small move) and
        ``o_proj`` takes the difference, its move put again from the original weight.
        """
        att, targets = block.attention, self.full.targets[block.path]
        assert att is not None and targets.v is not None and block.norm is not None
        z_node = self.advance_to(block.mlp_in)
        ctl = self.advance_to(block.control)
        x = rows(self.value(att.residual)).float()  # [k, d]
        o_first = rows(self.value(att.site.node)).float()  # [k, d]: the original W_o a
        found = self._split_two_norms(block, x, o_first, ctl)  # v -> about v_C
        found = self._split_two_norms(block, x, o_first, ctl)  # at the MLP's own magnitude
        z = rows(self.run.env[z_node]).detach().clone()  # [k, d_in], from the new v
        moved = moves.input_moves([self.weight(s) for s in block.inner], z, targets.z)
        for site, (u, v) in zip(block.inner, moved, strict=True):
            self._put(Delta(site.weight, block.path, u=u, v=v, layout=site.layout), ctl, site)
        y_node = self.view.by_name[block.residual_add]
        self._put_branch(block, found.u_star - self.branch_now(block), y_node)
        y = self.advance_to(block.residual_add)
        return BlockStats(
            block.path,
            True,
            todo.rule,
            block.output_control,
            input_norm=float(z.float().norm(dim=-1).min()),
            input_change=float((targets.z.float() - z.float()).abs().max()),
            residual_error=self._error(block, y),
            delta_norms={p: d.norm() for p, d in self.deltas.items() if d.block == block.path},
            unreached_norm=self._miss(block, y),
            reach_gap=max((0.0 if r.exact else r.miss) for r in found.reached),
        )

    def _split_two_norms(
        self, block: MlpBlock, x: torch.Tensor, o_first: torch.Tensor, ctl: fx.Node
    ) -> _TwoNorms:
        """Solve the two branches' outputs from the state now reached and put ``o_proj``'s
        move (from its original output ``o_first`` [k, d]) in place, recomputing up to
        ``ctl``; the down projection's target."""
        att, targets = block.attention, self.full.targets[block.path]
        assert att is not None and targets.v is not None and block.norm is not None
        # Constant gains after a scale multiply it (Beam, HyperCLOVA X): y = v + g s f.
        s_a, s_f = att.gain * self.scale_of(att.scale), block.gain * self.scale(block)  # [d]
        y_c, v_c = targets.y.float(), targets.v.float()  # [k, d]
        split = (_over(v_c - x, s_a), _over(y_c - v_c, s_f))  # the full run's, from x
        o_now, u_now = rows(self.value(att.site.node)).float(), self.branch_now(block)  # [k, d]
        f_a, f_f = self.normalized_at(att.norm), self.normalized(block)  # [k, d]
        a = rows(self.value(att.site.input))  # [k, d_attn]
        w_o, dtype = self.run.original_param(self.param_node[att.site.weight]), targets.y.dtype
        lams = (
            self._least_rounding(s_a, f_a, o_now, summed_terms(w_o, a, o_now), dtype),
            self._least_rounding(s_f, f_f, u_now, self.summed(block, u_now), dtype),
        )
        try:
            o_star, u_star, found = two_norm_targets(
                (s_a, s_f),
                y_c - x,
                split,
                (o_now, f_a, u_now, f_f),
                (att.norm.eps, block.norm.eps),
                lams,
            )
        except ValueError as exc:
            raise ConditionError(str(exc)) from exc
        u, v = moves.outer_move(o_star - o_first, a)
        self._put(
            Delta(att.site.weight, block.path, u=u, v=v, layout=att.site.layout), ctl, att.site
        )
        return _TwoNorms(u_star, tuple(found))

    def _least_rounding(
        self,
        s: torch.Tensor,
        f: torch.Tensor,
        out: torch.Tensor,
        summed: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The factor on a projection's reached magnitude at which its own rounding, through
        its post norm, is no larger than the branch output's (MATH.md 12) [k]."""
        r = out.double().pow(2).mean(dim=1, keepdim=True) / f.double().pow(2).mean(1, True)
        gain = s.double().abs()[None] / r.sqrt()  # [k, d]: |dy/du| at the reached magnitude
        t = s.double()[None] * f.double()  # [k, d]: the branch output's own size
        peak = out.abs().amax(dim=1)
        return choose_magnitude(gain, summed, t, peak, dtype)

    def _move_banks(self, block: MlpBlock, z: torch.Tensor, z_target: torch.Tensor) -> None:
        """Input move of the expert banks, each once the router has chosen its experts."""
        banks: dict[str, list[LinearSite]] = {}
        for site in block.inner:
            if site.experts:
                banks.setdefault(site.experts, []).append(site)
        for ids_name in sorted(banks, key=lambda n: self.view.index[self.view.by_name[n]]):
            ids_node = self.advance_to(ids_name)
            chosen = self.run.env[ids_node]  # each row's expert, or a split's chunks
            for site in banks[ids_name]:
                bank = self.run.param(self.param_node[site.weight])  # [E, ., .]
                given = self.value(site.tokens) if site.tokens else None  # JetMoE: z[tokens]
                found = moves.bank_input_move(bank, site, chosen, given, z, z_target)
                self._put(moves.bank_delta(site, block.path, found), ids_node, site)

    def _miss(self, block: MlpBlock, y: fx.Node) -> float:
        """``max_j ||y_j - y_C,j||``: what the block left for the blocks above (``lora``)."""
        now = rows(self.run.env[y]).float()  # [k, d]
        return float((now - self.full.targets[block.path].y.float()).norm(dim=-1).max())

    def _error(self, block: MlpBlock, y: fx.Node) -> float:
        """``max |y - y_C|`` as the patched run now computes ``y``."""
        now = rows(self.run.env[y]).float()  # [k, d]
        return float((now - self.full.targets[block.path].y.float()).abs().max())

    def _output_move(self, block: MlpBlock, todo: BlockPlan, y: fx.Node) -> _Output:
        """The output move at ``y``, and its figures."""
        y_target = self.full.targets[block.path].y  # [k, d], model dtype
        tail = [(s, rows(self.value(s.side)) if s.side else None) for s in block.tail]
        t = moves.control_target(y_target, tail)  # [k, d]: wanted value of the controlled part
        ctl = block.output_control
        if todo.rule == LORA_RULE and ctl in ("scale", "bias"):
            if todo.output_moves:  # the outer linear feeds the post norm: reach what it can
                return self._reach_fixed_scale(block, t, y)
            return _Output()
        if ctl == "scale":
            return self._scale_move(block, todo, t, y)
        if ctl == "bias":
            assert block.norm is not None and block.norm.bias is not None
            now = rows(self.value(block.control)).float()  # [1, d]
            db = t[0] - now[0]  # [d]: a bias adds any vector, no condition (MATH.md 1)
            self._put(Delta(block.norm.bias, block.path, vector=db), y, block)
            return _Output()
        if ctl not in ("linear", "experts"):  # pragma: no cover - the locator makes no other
            raise SolveError(block.path, f"unknown output control {ctl!r}")
        u_now = self.branch_now(block)  # [k, d]
        figure = rounding_gain(torch.ones(1), self.summed(block, u_now), t, None)
        gate_sum = self._put_branch(block, t - u_now, y)
        return _Output(gate_sum=gate_sum, rounding_gain=figure)

    def _reach_fixed_scale(self, block: MlpBlock, t: torch.Tensor, y: fx.Node) -> _Output:
        """The ``lora`` rule behind a post norm: the outer output nearest the target, at the
        magnitude of least rounding (MATH.md 10, 12); the scale stays."""
        s, u_now = self.scale(block), self.branch_now(block)  # [d], [k, d]
        summed = self.summed(block, u_now)  # [k, d]
        u_star = reachable_outputs(s, t, u_now)  # [k, d], at the reached rms
        gain = s.double().abs()[None] / u_now.double().pow(2).mean(dim=1, keepdim=True).sqrt()
        peak = u_star.abs().amax(dim=1)
        lam = choose_magnitude(gain, summed, t, peak, self.full.targets[block.path].y.dtype)
        gate_sum = self._put_branch(block, lam[:, None].float() * u_star - u_now, y)
        figure = rounding_gain(gain, summed, t, lam.tolist())
        return _Output(None, gate_sum, float(lam.max()), figure)

    def _scale_move(self, block: MlpBlock, todo: BlockPlan, t: torch.Tensor, y) -> _Output:
        sc = block.scale
        assert sc is not None and block.norm is not None
        u_now = self.branch_now(block)  # [k, d]
        summed = self.summed(block, u_now)  # [k, d], at the reached state (MATH.md 12)
        gate_sums: list[float] = []

        def reach(residual: torch.Tensor | None) -> torch.Tensor:
            if residual is not None:
                gate_sums.append(self._put_branch(block, residual, y) or 0.0)
            return self.normalized(block)  # [k, d]

        y_target = self.full.targets[block.path].y  # [k, d], model dtype
        stable = todo.stable or t.shape[0] > 1  # the outer moves first (MATH.md 4, 9)
        move: ScaleMove
        if t.shape[0] > 1 or (todo.stable and not block.norm.centered):  # MATH.md 9; 8: gains
            f_now = self.normalized(block)  # [k, d]
            move = moves.shared_scale_move(
                self.scale(block), t, y_target, u_now, f_now, reach, summed
            )
        else:
            move = moves.scale_move(self.scale(block), t, y_target[0], u_now, reach, summed, stable)
        self._put(Delta(sc.param, block.path, vector=move.ds / sc.alpha), y, block)
        gate_sum = min(gate_sums) if gate_sums and block.experts is not None else None
        return _Output(move, gate_sum, move.magnitude, move.rounding_gain)

    def _put_branch(self, block: MlpBlock, residual: torch.Tensor, y: fx.Node) -> float | None:
        """Add ``residual`` [k, d] to the outer function's output: the outer linear's output
        move, or every active expert's by the gate sum (MATH.md 1); the smallest gate sum."""
        if block.experts is None:
            h = rows(self.value(block.activation))  # [k, d_ff]
            u, v = moves.outer_move(residual, h)  # u [d, k], v [d_ff, k]
            site = block.outer
            self._put(Delta(site.weight, block.path, u=u, v=v, layout=site.layout), y, site)
            return None
        got = self.expert_rows(block)
        gate_sum, found = moves.experts_output_move(
            residual, got.ids, got.gates, got.h, block.experts.top_k, got.tokens
        )
        self._put(moves.bank_delta(block.outer, block.path, found), y, block.outer)
        return gate_sum

    # -- putting a delta in place -------------------------------------------------------------

    def _put(self, delta: Delta, upto: fx.Node, at: LinearSite | MlpBlock) -> None:
        """Put ``delta`` in place: baked into the weight, or (``lowrank``) as an action on the
        output of ``at`` (a linear site, or the block whose scale or bias it changes)."""
        held = self.deltas.get(delta.param)
        if held is not None and held.block != delta.block:
            raise SolveError(
                delta.block,
                f"{delta.param} is shared with block {held.block}: one "
                "parameter cannot take two blocks' patches",
            )
        self.deltas[delta.param] = delta
        if self.apply == "lowrank":
            # A delta put again replaces the first: its action adds what the first did not.
            more = delta if held is None else _beyond(delta, held)
            target, act = self._action(more, at)
            self.run.add_action(self.view.by_name[target], act, upto)
            return
        node = self.param_node[delta.param]
        # Put again, a delta is baked from the original weight, as the artefact holds it.
        base = self.run.param(node) if held is None else self.run.original_param(node)
        # In-memory weights are baked into the pool's buffers (reclaimed once the block is
        # done); an offloaded one's rebake runs later, when its value may be held: its own.
        rebake = lambda b: delta.materialize(b, aligned=True)  # noqa: E731
        value = delta.materialize(base, pool=self.pool)
        self.run.replace_param(node, value, upto, rebake=rebake)

    def _action(self, delta: Delta, at: LinearSite | MlpBlock) -> tuple[str, Action]:
        """The node a delta acts on and the action, computed in float32 beside the weights."""
        if isinstance(at, LinearSite):
            ids_node = self.view.by_name[at.experts or ""] if delta.experts else None
            x_node = self.view.by_name[at.input]
            return at.node, linear_action(delta, self.run.env, x_node, ids_node)
        return vector_action(delta, at, self.normalized)


@dataclass(frozen=True)
class _TwoNorms:
    """The down projection's target ``u*`` [k, d] and each position's :class:`TwoNormReach`."""

    u_star: torch.Tensor
    reached: tuple[TwoNormReach, ...]


def _beyond(delta: Delta, held: Delta) -> Delta:
    """What ``delta`` adds beyond ``held``, a delta of the same linear with the same right
    factor (both from the linear's input, which the moves do not change)."""
    assert delta.u is not None and held.u is not None and delta.v is not None
    assert held.v is not None and torch.equal(delta.v, held.v), "another right factor"
    return dataclasses.replace(delta, u=delta.u - held.u)


def _lora_hint(block: MlpBlock, todo: BlockPlan) -> str:
    """Where the ``lora`` rule serves a block another rule cannot (a post-norm scale shared by
    k positions): o_proj and down_proj set each position (MATH.md 10)."""
    if block.attention is None or todo.rule == LORA_RULE or not todo.post_norm_scale:
        return ""
    return "; the lora rule moves o_proj and down_proj per position instead (MATH.md 10)"


def _over(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``t / s`` [k, d] where ``s != 0``, 0 elsewhere."""
    return torch.where(s != 0, t / torch.where(s != 0, s, torch.ones_like(s)), 0.0)


def solve(
    traced: TracedModel,
    blocks: BlockMap,
    full: FullRun,
    query_ids: torch.Tensor,
    update: str = DEFAULT_RULE,
    start_layer: int = 0,
    on_block: Callable[[int, int, str], None] | None = None,
    apply: str = "baked",
    skip: Mapping[str, str] | None = None,
    ops: Mapping[str, Callable] | None = None,
    wait: Callable[[str], None] | None = None,
    abs_memo: AbsWeights | None = None,
    inner_outputs: bool = False,
) -> Solution:
    """Compute every block's patch in one reduced pass (pure: the model is not modified).

    Args:
        traced: the exported model.
        blocks: the located blocks, in graph order.
        full: the full run's targets (:func:`record_targets`).
        query_ids: int64 [1, k], the query alone.
        update: one of ``ctxc.core.vocabulary.RULES`` (their meanings there), validated where it
            entered the library (``CompileOptions``, ``generate``); ``lora`` behind a post norm
            is not exact (``unreached_norm``).
        start_layer: blocks with index below it stay unpatched (ablation C.4).
        on_block: progress callback ``(done, total, path)``.
        apply: validated like ``update``: ``baked`` (each patch materialised into its weight in
            the model's dtype, as the emitted model holds it) or ``lowrank`` (each delta added as
            a float32 action on its linear's output, beside the unchanged weights: MATH.md 6,
            bfloat16 rounds a baked patch away).
        skip: block path -> reason, for blocks to leave unpatched (a condition they failed).
        ops: node name -> ``fn(*args, **kwargs)`` computing that node instead of its op
            (``ctxc generate`` computes the LM head with the baseline's, one weight read).
        wait: ``wait(block path)`` returns once that block's targets are in ``full.targets``
            (``ctxc generate`` records them on another thread while the solver runs).
        abs_memo: kept by the caller between solves on the same weights: the outer linears'
            ``|W|`` (MATH.md 12), formed once instead of at every solve (``ctxc generate``:
            18 x 5 MB on Gemma 3 270M, a fifth of a step's solve). Filled here.
        inner_outputs: the targets carry the inner linears' outputs ``W z_C``
            (:attr:`BlockTargets.inner`; ``ctxc generate`` records them with its decode step):
            the run keeps those linears' outputs, and a block whose targets hold them takes its
            input moves from them (``u = W z_C - W z``) instead of ``W (z_C - z)``.

    Returns:
        the :class:`Solution`.

    Raises:
        SolveError: a block's condition fails (zero norm, zero divisor, gate sum 0), with its
            value.
    """
    skip = skip or {}
    k = int(query_ids.shape[1])
    plans = [
        checked_plan(GraphView.of(traced), block, update, k)
        if i >= start_layer and block.path not in skip
        else None
        for i, block in enumerate(blocks.blocks)
    ]
    patched = [b for b, p in zip(blocks.blocks, plans, strict=True) if p is not None]
    keep = set().union(*(moves.output_reads(b) for b in patched))
    if inner_outputs:  # read back, and the moves added to them without a second product
        keep.update(s.node for b in patched for s in b.inner if not s.experts)
    stops = blocks.node_names
    solver = _Solver(traced, full, query_ids, apply, keep, stops, ops or {}, abs_memo)
    stats = []
    with torch.no_grad():
        for i, (block, todo) in enumerate(zip(blocks.blocks, plans, strict=True)):
            if wait is not None:
                wait(block.path)
            if todo is None:
                stats.append(solver.skip_block(block, skip.get(block.path, "")))
            else:
                try:
                    stats.append(solver.patch_block(block, todo))
                except ConditionError as exc:
                    raise SolveError(block.path, str(exc) + _lora_hint(block, todo)) from exc
            solver.run.release()  # an offloaded block's patched weights: back to its store
            solver.pool.reclaim()  # the run reads this block's patched weights no more
            if on_block is not None:
                on_block(i + 1, len(blocks.blocks), block.path)
        logits = solver.logits()  # [k, vocab]
    return Solution(deltas=dict(solver.deltas), stats=tuple(stats), logits=logits)
