"""Solver of a thought patch: the exact solver generalised from one query position to N.

One :class:`~ctxc.passes.runtime.reduced_run.ReducedRun` per fit query runs in lockstep, block by
block,
along the emitted computation (MATH.md 3, 8): at the MLP input, the input moves of every inner
linear are fitted over all N positions of all queries (:mod:`fit_moves`) and baked into the
weights before the inner linears run; at the block output, the output move (outer linear, then
a post-norm scale; or a bias) is fitted the same way to the full run's targets ``y_C`` and baked,
so the next block's input is what the patched model computes, and each block's target is the
full run's block output (self-correcting). With one query, ridge 0 and no rank budget every
fit is exact and the deltas are those of :func:`~ctxc.passes.solver.solve.solve` (stable rule).

With ``attention_moves``, a block with an attention surface (sandwich norms) first fits its
attention output projection and post-attention scale so the residual after the attention
reaches the full run's ``v_C`` (:meth:`_Fitter._attention`), then its MLP moves as above.

A refit pass (``passes > 1``) runs the queries again from the start with the previous pass's
deltas in place and fits each block's remaining error on top of them (the earlier blocks now
refitted, so each block sees what they produce after the refit); the two moves are summed and,
under a rank budget, cut back to it by an SVD of the sum. Ridge shrinks each pass's move, so a
second pass is also a weaker ridge on the whole.
Pure: the model and the graph are not modified; the runs' values are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ctxc.core.errors import SolveError
from ctxc.frontend.trace import TracedModel
from ctxc.passes.locate.block_map import BlockMap, LinearSite, MlpBlock, NormSite, ScaleSite
from ctxc.passes.locate.graph_view import GraphView
from ctxc.passes.runtime.reduced_run import ReducedRun
from ctxc.passes.runtime.run_graph import BlockTargets
from ctxc.passes.solver import block_moves as moves
from ctxc.passes.solver.fit_moves import (
    FitOptions,
    LsInput,
    fit_bias,
    fit_linear,
    fit_scale,
    stable_targets,
)
from ctxc.passes.solver.output_magnitude import least_rounding_targets, summed_terms
from ctxc.passes.solver.primitive_moves import ConditionError
from ctxc.patch import Delta

__all__ = ["FitBlock", "FitSolution", "Lockstep", "effective_rank", "fit_solve", "summed_delta"]


@dataclass(frozen=True)
class FitBlock:
    """How well one block's moves fitted its N positions.

    Attributes:
        path: module path of the block.
        move_residuals: parameter name -> relative residual of its fit (0 exact, 1 nothing).
        residual_rms: RMS of ``y - y_C`` over all positions after the block's moves.
        target_rms: RMS of ``y_C``, for scale.
        effective_rank: participation ratio of the per-position exact input moves of the
            first inner linear (1: one shared patch could serve all positions; N: none).
        delta_norms: parameter name -> Frobenius norm of its delta.
        ranks: matrix parameter name -> the rank of its delta.
    """

    path: str
    move_residuals: dict[str, float]
    residual_rms: float
    target_rms: float
    effective_rank: float
    delta_norms: dict[str, float] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class FitSolution:
    """The fitted deltas and each block's figures.

    Attributes:
        deltas: parameter name -> :class:`Delta`, in graph order.
        blocks: one :class:`FitBlock` per block.
    """

    deltas: dict[str, Delta]
    blocks: tuple[FitBlock, ...]


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _sq_norms(x: torch.Tensor) -> torch.Tensor:
    """[N, 1]: each row's squared norm (floored: a zero row divides nothing)."""
    return x.pow(2).sum(1, keepdim=True).clamp_min(1e-30)


def _same_inner_products(d: torch.Tensor, w: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """Rows with the inner products of the rows of ``dw = d @ w.T`` ([N, in] times [out, in])
    in fewer columns: ``d L`` [N, in] with ``L L^T = W^T W`` when out > in (a gate or up
    projection: its Gram in :func:`effective_rank` costs N^2 in instead of N^2 out, 576
    against 1536 on SmolLM2), else ``dw`` itself (also when ``W^T W`` has no Cholesky
    factor)."""
    if w.shape[0] <= w.shape[1]:
        return dw
    chol, info = torch.linalg.cholesky_ex(w.double().T @ w.double())  # [in, in]
    return dw if int(info) != 0 else (d.double() @ chol).float()


def effective_rank(a: torch.Tensor, b: torch.Tensor) -> float:
    """Participation ratio of the rank-1 matrices ``a_j b_j^T`` (a [N, out], b [N, in]).

    Their Gram is ``G = (A A^T) * (B B^T)`` (PSD: a Hadamard product of PSD matrices); the
    ratio ``(sum l)^2 / sum l^2`` of its eigenvalues counts the directions they spread over. It
    is ``tr(G)^2 / ||G||_F^2``, with no eigendecomposition (an N = 4224 eigvalsh took 7 s).
    The two Grams are float32 and the sums float64: at N = 1285 (a default bake of a SQuAD
    paragraph) the ratio moves by 4e-10 relative, at 0.6x the time (18 blocks: ~6 s of one
    thread; issue 55).
    """
    gram = (a.float() @ a.float().T) * (b.float() @ b.float().T)  # [N, N]
    total = float(gram.double().pow(2).sum())
    return float(gram.diagonal().double().sum() ** 2 / total) if total > 0 else 0.0


class Lockstep:
    """One reduced run per query, advanced together; values no later node reads are dropped
    (many queries' runs must fit in memory). Mutates only the runs."""

    def __init__(self, traced: TracedModel, queries: Sequence[torch.Tensor], keep: set[str]):
        self.view = view = GraphView.of(traced)
        nodes = [view.by_name[n] for n in keep]
        self.runs = [ReducedRun(view, nodes, traced.placeholder_values(q)) for q in queries]
        self.last_use = {n: max((view.index[u] for u in n.users), default=-1) for n in view.nodes}

    def advance(self, name: str) -> list[torch.Tensor]:
        node = self.view.by_name[name]
        return [_rows(run.advance_to(node)) for run in self.runs]

    def values(self, name: str) -> torch.Tensor:
        """A node's value at every position of every run, rows stacked [N, d]."""
        node = self.view.by_name[name]
        return torch.cat([_rows(run.value(node)) for run in self.runs])

    def put(self, param: str, value: torch.Tensor, upto: str) -> None:
        node, stop = self.view.param_node[param], self.view.by_name[upto]
        for run in self.runs:
            run.replace_param(node, value, stop)

    def param(self, name: str) -> torch.Tensor:
        return self.runs[0].env[self.view.param_node[name]]

    def original(self, name: str) -> torch.Tensor:
        """A parameter's value before any delta was put (a refit sums onto the original)."""
        return self.runs[0].original_param(self.view.param_node[name])

    def drop_before(self, name: str) -> None:
        at = self.view.index[self.view.by_name[name]]
        for run in self.runs:
            for node in [n for n in run.env if n.op != "placeholder" and self.last_use[n] < at]:
                del run.env[node]
                run.kept.pop(node, None)


class _Fitter:
    """Fits and bakes each block's moves over all runs' positions."""

    def __init__(
        self,
        runs: Lockstep,
        targets: dict[str, BlockTargets],
        opts: FitOptions,
        rows: torch.Tensor | None,
        start: dict[str, Delta] | None = None,
        weights: torch.Tensor | None = None,
        priors: Mapping[str, torch.Tensor] | None = None,
    ):
        self.runs, self.targets, self.opts = runs, targets, opts
        self.priors = priors or {}  # weight name -> its ridge's metric [in, in] (fit_linear)
        self.base_opts = opts  # ``opts`` is this block's (its own rank: rank_per_block)
        self.rows = rows  # [N] bool: the positions that are constraints (None: all)
        # [N'] the square roots of the fitted rows' weights (None: 1 each): a row of weight w
        # scaled by sqrt(w) on both sides of every least-squares fit counts as w copies of it.
        picked = weights if weights is None or rows is None else weights[rows]
        self.root = None if picked is None else picked.double().sqrt()
        self.start = start or {}  # the previous pass's deltas (a refit pass)
        self.deltas: dict[str, Delta] = {}
        self.resid: dict[str, float] = {}

    def block(self, block: MlpBlock) -> FitBlock:
        self.resid = {}
        self.opts = self.base_opts
        if self.opts.attention_moves and block.attention is not None:
            self._attention(block)
        z = torch.cat(self.runs.advance(block.mlp_in)).float()  # [N, d_in]
        self._start_from(block, block.mlp_in)
        z_c = self.targets[block.path].z.float()  # [N, d_in]
        sites = [s for s in block.inner if not s.experts]
        if len(sites) != len(block.inner) or block.output_control == "experts":
            raise SolveError(block.path, "bake does not fit MoE expert banks (exact compile does)")
        rank = 0.0
        zf = self._fit_rows(z)  # [N', d_in]
        shared = LsInput(zf)  # the gate's and the up's fits share its Gram and R
        for i, site in enumerate(sites):
            w = self._weight(site).float()  # [out, in]
            if site.weight in self.start:  # W0 z_C - W z: W is W0 plus the last pass's move
                w0 = self.runs.original(site.weight).float()
                w0 = w0.T if site.layout == "in_out" else w0  # [out, in]
                want = self._fit_rows(z_c @ w0.T - z @ w.T)  # [N', out]
                spread = want
            else:
                want = self._fit_rows((z_c - z) @ w.T)  # [N', out]: W (z_C - z) at each position
                spread = None  # from z_C - z below: the same inner products in fewer columns
            if i == 0:
                if spread is None:
                    spread = _same_inner_products(self._fit_rows(z_c - z), w, want)
                rank = effective_rank(spread, zf / _sq_norms(zf))
                self.opts = self._block_options(rank)
            if not self.opts.input_moves:
                continue
            fit = fit_linear(shared, want, self.opts, "MLP input z", self.priors.get(site.weight))
            self._put(
                Delta(site.weight, block.path, u=fit.u, v=fit.v, layout=site.layout),
                block.mlp_in,
                fit.rel_residual,
            )
        self.runs.advance(block.residual_add)
        self._output(block)
        y = self.runs.values(block.residual_add).float()  # [N, d]
        y_c = self.targets[block.path].y.float()  # [N, d]
        return FitBlock(
            block.path,
            dict(self.resid),
            residual_rms=float((y - y_c).pow(2).mean().sqrt()),
            target_rms=float(y_c.pow(2).mean().sqrt()),
            effective_rank=rank,
            delta_norms={p: d.norm() for p, d in self.deltas.items() if d.block == block.path},
            ranks={p: d.rank for p, d in self.deltas.items() if d.block == block.path and d.rank},
        )

    def skip(self, block: MlpBlock) -> FitBlock:
        """Run ``block`` without moving it (``FitOptions.moved_blocks``): a refit pass keeps
        its earlier deltas as they were; its figures say what is left for the next blocks."""
        self.runs.advance(block.residual_add)
        self._start_from(block, block.residual_add)
        for param, before in self.start.items():
            if before.block == block.path:
                self.deltas[param] = before
        y = self.runs.values(block.residual_add).float()  # [N, d]
        y_c = self.targets[block.path].y.float()  # [N, d]
        return FitBlock(
            block.path,
            {},
            residual_rms=float((y - y_c).pow(2).mean().sqrt()),
            target_rms=float(y_c.pow(2).mean().sqrt()),
            effective_rank=0.0,
        )

    def _start_from(self, block: MlpBlock, upto: str, only: set[str] | None = None) -> None:
        """Put the previous pass's deltas of ``block`` (of ``only``) not yet put: a refit pass
        starts from them. Recomputes up to ``upto`` (call after the advance: it loads the
        params)."""
        for param, before in self.start.items():
            if before.block != block.path or param in self.deltas:
                continue
            if only is None or param in only:
                base = self.runs.param(param)
                self.runs.put(param, before.materialize(base, aligned=True), upto)

    def _attention(self, block: MlpBlock) -> None:
        """The attention output projection's move, then its post-norm scale's, fitted so the
        residual after the attention ``v = x + g s_a norm(W_o a)`` reaches the full run's ``v_C``
        (the ``lora`` rule's second surface, MATH.md 10, in the least-squares sense): a rank-r
        move of ``W_o`` reads the attention output ``a``, which carries each query's own mix."""
        att, v_c = block.attention, self.targets[block.path].v
        assert att is not None
        if v_c is None:
            raise SolveError(block.path, "no full-run value of the residual after the attention")
        self.runs.advance(att.add)
        self._start_from(block, att.add, {att.site.weight, att.scale.param})
        x = self.runs.values(att.residual).float()  # [N, d]
        t = (v_c.float() - x) / att.gain  # [N, d]: what s_a * norm(o) must become
        s = self._scale_of(att.scale)  # [d]
        a = self.runs.values(att.site.input).float()  # [N, d_attn]
        o_now = self._outer_now(att.site, a)  # [N, d]
        move = stable_targets(s, t, o_now) - o_now  # [N, d]
        if self.base_opts.rank_per_block:  # its own measured effective rank, as the MLP's
            af = self._fit_rows(a)
            self.opts = self._block_options(
                effective_rank(self._fit_rows(move), af / _sq_norms(af))
            )
        self._put_linear(block.path, att.site, a, move, att.add, "attention a")
        if not self.opts.linear_only:
            self._put_scale(block.path, att.norm, s, t, att.add)

    def _output(self, block: MlpBlock) -> None:
        y_c = self.targets[block.path].y  # [N, d]
        tail = [(s, self.runs.values(s.side) if s.side else None) for s in block.tail]
        t = moves.control_target(y_c, tail)  # [N, d]
        ctl, site = block.output_control, block.outer
        if ctl == "linear":
            h = self.runs.values(block.activation).float()  # [N, d_ff]
            self._put_outer(block, t - self._outer_now(site, h), h)
        elif ctl == "bias":
            if self.opts.linear_only:
                raise SolveError(block.path, "its output is set by a norm bias: not linear-only")
            assert block.norm is not None and block.norm.bias is not None
            now = self.runs.values(block.control).float()  # [N, d]
            d = self._fit_rows(t - now)  # [N', d], each row times sqrt(w)
            delta = Delta(block.norm.bias, block.path, vector=fit_bias(d, self.root))
            self._put(delta, block.residual_add, 0.0)
        elif ctl == "scale":
            sc = block.scale
            assert sc is not None
            if not block.stable_ok:
                raise SolveError(block.path, "ops between the down projection and the post norm")
            s = self._scale_of(sc)  # [d]
            h = self.runs.values(block.activation).float()  # [N, d_ff]
            u_now = self._outer_now(site, h)  # [N, d]
            assert block.norm is not None
            if t.shape[0] == 1 and not block.norm.centered:
                # One position: the exact stable rule's least-ratio target at the magnitude of
                # least rounding (MATH.md 8, 9, 12), so a one-position bake is the exact
                # compile; N positions: each its nearest target.
                rho = self._normalized(block).double().pow(2).mean(1)  # [1]
                summed = summed_terms(self._weight(site), h, u_now)  # MATH.md 12
                dtype = self.targets[block.path].y.dtype
                want = least_rounding_targets(s, t, u_now, rho, summed, dtype)[0].targets
            else:
                want = stable_targets(s, t, u_now)  # [N, d]
            self._put_outer(block, want - u_now, h)
            if not self.opts.linear_only:
                self._put_scale(block.path, block.norm, s, t, block.residual_add)
        else:  # pragma: no cover - the locator makes only the kinds above
            raise SolveError(block.path, f"unknown output control {ctl!r}")

    def _block_options(self, effective: float) -> FitOptions:
        """The options of this block's fits: its own rank when ranks follow the blocks."""
        if not self.base_opts.rank_per_block:
            return self.base_opts
        own = max(1, math.ceil(effective))
        cap = self.base_opts.rank
        return dataclasses.replace(self.base_opts, rank=own if cap is None else min(own, cap))

    def _fit_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The fitted rows of ``x`` [N, k], each times the square root of its weight."""
        x = x if self.rows is None else x[self.rows]
        return x if self.root is None else x * self.root.to(x.dtype)[:, None]

    def _put_outer(self, block: MlpBlock, residual: torch.Tensor, h: torch.Tensor) -> None:
        self._put_linear(
            block.path, block.outer, h, residual, block.residual_add, "MLP activation h"
        )

    def _put_linear(
        self, path: str, site: LinearSite, x: torch.Tensor, move: torch.Tensor, upto: str, what: str
    ) -> None:
        """Fit ``site``'s move (``x`` [N, in] -> ``move`` [N, out] at the fit rows) and put it."""
        prior = self.priors.get(site.weight)
        fit = fit_linear(self._fit_rows(x), self._fit_rows(move), self.opts, what, prior)
        delta = Delta(site.weight, path, u=fit.u, v=fit.v, layout=site.layout)
        self._put(delta, upto, fit.rel_residual)

    def _put_scale(
        self, path: str, norm: NormSite, s: torch.Tensor, t: torch.Tensor, upto: str
    ) -> None:
        """Fit ``norm``'s scale so ``(s + ds) * f ~ t`` [N, d] over the fit rows, ``f`` the
        normalised value recomputed after the linear move (MATH.md 8), and put it."""
        sc = norm.scale
        assert sc is not None
        f = self._fit_rows(self._normalized_at(norm))  # [N', d]
        found = fit_scale(s, f, self._fit_rows(t), self.opts.scale_ridge)
        self._put(Delta(sc.param, path, vector=found.ds / sc.alpha), upto, found.rel_residual)

    def _scale_of(self, sc: ScaleSite) -> torch.Tensor:
        """A norm's effective scale ``alpha * w + offset`` [d], float32, as now put."""
        return sc.alpha * self.runs.param(sc.param).float() + sc.offset

    def _put(self, delta: Delta, upto: str, rel: float) -> None:
        if delta.param in self.deltas:
            raise SolveError(delta.block, f"{delta.param} is shared with another block")
        before = self.start.get(delta.param)
        if before is not None:
            delta = summed_delta(before, delta, self.opts.rank)
        self.deltas[delta.param] = delta
        self.resid[delta.param] = rel
        base = self.runs.original(delta.param)
        self.runs.put(delta.param, delta.materialize(base, aligned=True), upto)

    def _weight(self, site: LinearSite) -> torch.Tensor:
        w = self.runs.param(site.weight)
        return w.T if site.layout == "in_out" else w  # [out, in]

    def _outer_now(self, site: LinearSite, h: torch.Tensor) -> torch.Tensor:
        u_now = h @ self._weight(site).float().T  # [N, d]
        if site.bias is not None:
            u_now = u_now + self.runs.param(site.bias).float()
        return u_now

    def _normalized(self, block: MlpBlock) -> torch.Tensor:
        assert block.norm is not None
        return self._normalized_at(block.norm)

    def _normalized_at(self, norm: NormSite) -> torch.Tensor:
        """A post norm's normalised value ``f`` [N, d] its scale multiplies, as now computed."""
        sc = norm.scale
        assert sc is not None
        if sc.normalized:
            return self.runs.values(sc.normalized).float()
        x = self.runs.values(norm.input).float()  # [N, d]
        eps = norm.eps if norm.eps is not None else 1e-5
        if norm.centered:
            return F.layer_norm(x, (x.shape[-1],), None, None, eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps)


def summed_delta(a: Delta, b: Delta, rank: int | None) -> Delta:
    """``a + b`` of one parameter, a matrix sum cut back to ``rank`` (its top singular values).

    Returns:
        a :class:`Delta` of rank ``a.rank + b.rank``, at most ``rank``.
    """
    if a.vector is not None:
        assert b.vector is not None
        return dataclasses.replace(a, vector=a.vector + b.vector)
    assert a.u is not None and a.v is not None and b.u is not None and b.v is not None
    u = torch.cat([a.u, b.u], dim=-1).double()  # [out, r_a + r_b]
    v = torch.cat([a.v, b.v], dim=-1).double()  # [in, r_a + r_b]
    if rank is not None and u.shape[-1] > rank:
        qu, ru = torch.linalg.qr(u)  # u v^T = qu (ru rv^T) qv^T
        qv, rv = torch.linalg.qr(v)
        left, sv, right = torch.linalg.svd(ru @ rv.T)  # [r, r] each
        u = qu @ (left[:, :rank] * sv[:rank])  # [out, rank]
        v = qv @ right[:rank].T  # [in, rank]
    return dataclasses.replace(a, u=u.float().contiguous(), v=v.float().contiguous())


def fit_solve(
    traced: TracedModel,
    blocks: BlockMap,
    targets: dict[str, BlockTargets],
    queries: Sequence[torch.Tensor],
    opts: FitOptions,
    on_block: Callable[[int, int, str], None] | None = None,
    rows: torch.Tensor | None = None,
    passes: int = 1,
    weights: torch.Tensor | None = None,
    start: dict[str, Delta] | None = None,
    priors: Mapping[str, torch.Tensor] | None = None,
) -> FitSolution:
    """Fit one patch over every position of every query, block by block (pure).

    Args:
        traced: the exported model (one export for every query length).
        blocks: the located blocks, in graph order.
        targets: block path -> the full runs' targets at every fit position, rows in the order
            of ``queries`` and their positions (``z`` [N, d_in], ``y`` [N, d]).
        queries: the reduced inputs, int64 [1, k_i] each; N = sum of k_i.
        opts: ridge and rank (:class:`FitOptions`).
        on_block: progress callback ``(done, total, block path)``.
        rows: [N] bool, the positions that are constraints (None: every one); the others are
            run (later positions attend to them) but not fitted.
        passes: 1, or more for refit passes (module docstring).
        weights: [N] float, each position's weight in every fit (a position of weight ``w``
            counts as ``w`` copies of it); None: 1 each. The effective rank does not depend on
            them (each position's exact move ``y x^T / ||x||^2`` is the same scaled).
        start: deltas to fit on top of, as a refit pass does (its first pass is then a refit
            pass over these queries: each block's remaining error, the moves summed).
        priors: weight name -> the metric ``M`` [in, in] of that linear's ridge
            (:func:`~ctxc.passes.solver.fit_moves.fit_linear`'s ``prior``; a bake's
            ``BakeOptions.prior``: ``ctxc.bake.prior``); a linear not named: the identity.

    Returns:
        the :class:`FitSolution` (the figures of the last pass).

    Raises:
        SolveError: a block the fit cannot move (an MoE bank, a zero input), with its reason.
    """
    keep = set().union(*(moves.output_reads(b) for b in blocks.blocks))
    deltas: dict[str, Delta] = dict(start or {})
    stats: list[FitBlock] = []
    total = passes * len(blocks.blocks)
    for p in range(passes):
        fitter = _Fitter(
            Lockstep(traced, queries, keep),
            targets,
            opts,
            rows,
            start=deltas,
            weights=weights,
            priors=priors,
        )
        stats = []
        moved = set(opts.moved(len(blocks.blocks)))
        with torch.no_grad():
            for i, block in enumerate(blocks.blocks):
                try:
                    stats.append(fitter.block(block) if i in moved else fitter.skip(block))
                except ConditionError as exc:
                    raise SolveError(block.path, str(exc)) from exc
                fitter.runs.drop_before(block.residual_add)
                if on_block is not None:
                    on_block(p * len(blocks.blocks) + i + 1, total, block.path)
        deltas = dict(fitter.deltas)
    return FitSolution(deltas, tuple(stats))
