"""What the solver reads off its reduced run: node values, a block's weights, its outer output.

:class:`SolverValues` is the reading half of the solver (:mod:`ctxc.passes.solver.solve`): it holds
the run and the graph view and computes the values each move needs, in float32, as the run
reached them. Analysis: nothing here mutates the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from ctxc.passes.locate.block_map import LinearSite, MlpBlock, NormSite, ScaleSite
from ctxc.passes.locate.graph_view import GraphView
from ctxc.passes.runtime.delta_actions import row_experts
from ctxc.passes.runtime.reduced_run import ReducedRun
from ctxc.passes.solver.output_magnitude import AbsWeights, bank_summed_terms, summed_terms

__all__ = ["ExpertRows", "SolverValues", "rows"]

aten = torch.ops.aten


def rows(x: torch.Tensor) -> torch.Tensor:
    """Positions as rows: [1, k, d] or [k, d] -> [k, d] (a view)."""
    return x.reshape(-1, x.shape[-1])


@dataclass(frozen=True)
class ExpertRows:
    """An MoE output bank's rows as the run reached them.

    Attributes:
        ids: each row's expert [rows]; gates: its routing weight [rows], float32;
        h: its activation [rows, d_ff], float32; tokens: its query position [rows], or None
            (``top_k`` consecutive rows per position).
    """

    ids: torch.Tensor
    gates: torch.Tensor
    h: torch.Tensor
    tokens: torch.Tensor | None


class SolverValues:
    """The run, the graph, and the values the moves read. Subclassed by the solver."""

    view: GraphView
    run: ReducedRun
    param_node: dict[str, fx.Node]
    # the outer linears' |W|, kept by a caller that solves again on the same weights
    # (``solve(abs_memo=...)``); None: formed per use.
    abs_memo: AbsWeights | None = None

    def value(self, name: str) -> torch.Tensor:
        """A node's value as computed (its kept copy, when it has one)."""
        return self.run.value(self.view.by_name[name])

    def advance_to(self, name: str) -> fx.Node:
        """Run up to node ``name`` (included); the node."""
        node = self.view.by_name[name]
        self.run.advance_to(node)
        return node

    def weight(self, site: LinearSite) -> torch.Tensor:
        """A linear's weight as [out, in], as the run now holds it."""
        w = self.run.param(self.param_node[site.weight])
        return w.T if site.layout == "in_out" else w  # [out, in]

    def scale(self, block: MlpBlock) -> torch.Tensor:
        """The post norm's effective scale ``alpha * w + offset`` [d], float32."""
        assert block.scale is not None
        return self.scale_of(block.scale)

    def scale_of(self, sc: ScaleSite) -> torch.Tensor:
        """A norm's effective scale ``alpha * w + offset`` [d], float32."""
        w = self.run.param(self.param_node[sc.param]).float()  # [d]
        return sc.alpha * w + sc.offset

    def expert_rows(self, block: MlpBlock) -> ExpertRows:
        """The output bank's rows, their experts, gates and activations."""
        ex, site = block.experts, block.outer
        assert ex is not None and site.experts is not None
        return ExpertRows(
            ids=row_experts(self.value(site.experts)),
            gates=self.value(ex.gate).reshape(-1).float(),
            h=rows(self.value(site.input)).float(),
            tokens=self.value(ex.tokens).reshape(-1).long() if ex.tokens else None,
        )

    def branch_now(self, block: MlpBlock) -> torch.Tensor:
        """The outer function's output [k, d], float32: the outer linear's, or the experts'
        per-token sum (what a post norm behind it reads)."""
        if block.experts is not None:
            return rows(self.value(block.experts.combine)).float()
        return self.outer_now(block, rows(self.value(block.activation)))

    def summed(self, block: MlpBlock, u_now: torch.Tensor) -> torch.Tensor:
        """``m`` [k, d]: the outer function's terms its rounding scales with (MATH.md 12)."""
        site = block.outer
        if block.experts is None:
            w = self.weight(site)  # [out, in]
            h = rows(self.value(block.activation))  # [k, in]
            return summed_terms(w, h, u_now, self._abs_weight(site.weight, w))
        got = self.expert_rows(block)
        top_k = max(block.experts.top_k, 1)
        tokens = got.tokens if got.tokens is not None else torch.arange(len(got.ids)) // top_k
        bank = self.run.param(self.param_node[site.weight])  # [E, ., .]
        return bank_summed_terms(bank, site.layout, got.ids, got.gates, got.h, tokens, u_now)

    def _abs_weight(self, name: str, w: torch.Tensor) -> torch.Tensor | None:
        """``|W|`` of parameter ``name`` from :attr:`abs_memo`; None without one, or when
        ``w`` is no longer the parameter's original value (a patch replaced it)."""
        if self.abs_memo is None:
            return None
        node = self.param_node[name]
        if self.run.param(node) is not self.run.original_param(node):
            return None
        return self.abs_memo.get(name, w)

    def outer_now(self, block: MlpBlock, h: torch.Tensor) -> torch.Tensor:
        """The outer linear's output [k, d] in float32, from its input ``h`` [k, d_ff]."""
        site = block.outer
        node = self.view.by_name[site.node]
        w = self.weight(site)  # [out, in]
        if (
            node.target is aten.linear.default
            and len(node.args) == 2
            and h.dtype == w.dtype == torch.float32
            and not self.run.actions.get(node)
            and node in self.run.kept
        ):
            # The run computed it: aten.linear without a bias is matmul(x, W^T), the same mm
            # as ``h @ W^T`` below, bit for bit; its weights need not be read again.
            return rows(self.run.kept[node])
        u_now = h.float() @ w.float().T  # [k, d]
        if site.bias is not None:
            u_now = u_now + self.run.param(self.param_node[site.bias]).float()
        return u_now

    def normalized(self, block: MlpBlock) -> torch.Tensor:
        """The normalised MLP output ``f`` [k, d] the scale multiplies, as now computed."""
        assert block.norm is not None
        return self.normalized_at(block.norm)

    def normalized_at(self, norm: NormSite) -> torch.Tensor:
        """A post norm's normalised value ``f`` [k, d] its scale multiplies, as now computed."""
        sc = norm.scale
        assert sc is not None
        if sc.normalized:
            return rows(self.value(sc.normalized))
        x = rows(self.value(norm.input)).float()  # [k, d]: a fused norm's input
        eps = norm.eps if norm.eps is not None else 1e-5
        if norm.centered:
            return F.layer_norm(x, (x.shape[-1],), None, None, eps)
        return F.rms_norm(x, (x.shape[-1],), None, eps)
