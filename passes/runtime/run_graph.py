"""Interpreting the traced graph: a plain run, and a recording run over the full input.

Both runs walk the exported graph with ``torch.fx.Interpreter``, so they compute exactly the ops
the solver's reduced run computes. The recording run keeps, per block and at the query positions
only, the targets of MATH.md 3: the MLP input ``z_C`` and the block output ``y_C``. It frees
each value after its last use, applies the head to the query rows only, and computes attention
under a boolean mask on the key blocks each query chunk can see (``banded_attention``: the same
bits, a fraction of the scores at long contexts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import fx

from ctxc.frontend.trace import TracedModel
from ctxc.models.placement import Placer, PlacingInterpreter
from ctxc.passes.locate.block_map import BlockMap
from ctxc.passes.runtime.banded_attention import Band, banded_sdpa, mask_bands, sdpa_call, usable
from ctxc.passes.runtime.plain_head import default_forward_rows

__all__ = ["BlockTargets", "FullRun", "record_targets", "run_logits"]

aten = torch.ops.aten


@dataclass(frozen=True)
class BlockTargets:
    """The full run's values at the query positions for one block.

    Attributes:
        z: MLP input ``z_C`` [k, d_in], in the model's dtype.
        y: block output ``y_C`` [k, d_model], in the model's dtype.
        v: the residual after a sandwich-norm block's attention ``v_C`` [k, d_model], where
            the block has an attention surface (the ``lora`` rule starts from the full run's
            split of ``y_C - x`` between the two branches, MATH.md 10); else None.
        inner: module path -> that inner linear's output ``W z_C`` [k, out], where the run
            recorded them (``ctxc generate``'s decode step: the input moves then read no
            weight, MATH.md 1); else None.
    """

    z: torch.Tensor
    y: torch.Tensor
    v: torch.Tensor | None = None
    inner: Mapping[str, torch.Tensor] | None = None

    def leading(self, n: int) -> BlockTargets:
        """The first ``n`` rows (a shorter query set's, when the rows are stacked by query)."""
        inner = None if self.inner is None else {m: o[:n] for m, o in self.inner.items()}
        v = self.v[:n] if self.v is not None else None
        return BlockTargets(self.z[:n], self.y[:n], v, inner)


@dataclass(frozen=True)
class FullRun:
    """Targets of every block and the full-context logits at the query positions.

    Attributes:
        targets: block path -> :class:`BlockTargets`.
        logits: [k, vocab], float32: the head applied to the query rows alone, as the reduced
            run applies it (the solver's own reference).
        reference: [k, vocab], float32: the query rows as the model's default forward computes
            them, the head over every row (``passes/runtime/plain_head.py``); None when not asked
            for.
    """

    targets: dict[str, BlockTargets]
    logits: torch.Tensor
    reference: torch.Tensor | None = None


class _Recorder(PlacingInterpreter):
    """Runs the graph, keeping the last ``k`` positions of chosen nodes.

    Args:
        reference: also compute the head's query rows as the default forward does (the head's
            output is then ``[1, 2k, vocab]``: the query rows alone, then those).
        ops: node name -> ``fn(*args, **kwargs)`` computing that node instead of its op (an
            attention call given the runtime's own mask: ``compiler/runs/plain_attention.py``).
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        keep: set[str],
        head: str | None,
        k: int,
        placer: Placer | None,
        reference: bool = False,
        ops: Mapping[str, Callable] | None = None,
    ) -> None:
        super().__init__(gm, placer, garbage_collect_values=True)
        self.keep, self.head, self.k = keep, head, k
        self.reference, self.ops = reference, dict(ops or {})
        self.split = False  # the head's output holds both row sets
        self.kept: dict[str, torch.Tensor] = {}
        self.bands: dict[fx.Node, tuple[Band, ...]] = {}  # attention mask node -> its bands

    def run_node(self, n: fx.Node):
        if n.name == self.head and n.target == aten.linear.default:
            return self._head(n)
        out = None
        if n.name in self.ops:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            out = self.ops[n.name](*args, **kwargs)
        elif n.target is aten.scaled_dot_product_attention.default:
            out = self._banded(n)
        if out is None:
            out = super().run_node(n)
        if n.name in self.keep:
            # Rows are positions whatever the layout ([1, n, d], or [n, d] for OPT and Conv1D).
            self.kept[n.name] = out.reshape(-1, out.shape[-1])[-self.k :].detach().clone()  # [k, d]
        return out

    def _head(self, n: fx.Node) -> torch.Tensor:
        """The head on the query rows only (the full context's logits are not needed), and with
        ``reference`` also as the default forward computes those rows."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        x = args[0]  # [1, n, d]
        query = self.call_function(n.target, (x[..., -self.k :, :], *args[1:]), kwargs)
        if not self.reference:
            return query  # [1, k, vocab]

        def linear(rows: torch.Tensor, w, b) -> torch.Tensor:
            return self.call_function(n.target, (rows, w) if b is None else (rows, w, b), kwargs)

        bias = args[2] if len(args) > 2 else None
        plain = default_forward_rows(linear, x, args[1], bias, self.k)  # [1, k, vocab]
        self.split = True
        return torch.cat([query, plain], dim=-2)  # [1, 2k, vocab]

    def _banded(self, n: fx.Node) -> torch.Tensor | None:
        """Attention on the keys each query can see (bit for bit the whole call, see
        ``banded_attention``), or None when the call does not qualify."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        call = sdpa_call(n.target, args, kwargs)
        assert call is not None
        q, mask = call["query"], call["attn_mask"]
        if not usable(q, mask, call["dropout_p"], call["is_causal"]):
            return None
        node = n.args[3] if len(n.args) > 3 else n.kwargs["attn_mask"]
        assert isinstance(node, fx.Node)  # usable(): the mask is a tensor, so a node's value
        if node not in self.bands:  # masks are shared by many layers: scan each once
            self.bands[node] = mask_bands(mask)
        extra = {"enable_gqa": call["enable_gqa"]} if "enable_gqa" in call else {}
        return banded_sdpa(
            q, call["key"], call["value"], mask, self.bands[node], call["scale"], **extra
        )


def _last_positions(logits: torch.Tensor, k: int) -> torch.Tensor:
    return logits[0, -k:].float()  # [k, vocab]


def record_targets(
    traced: TracedModel,
    blocks: BlockMap,
    input_ids: torch.Tensor,
    k: int,
    reference: bool = False,
    ops: Mapping[str, Callable] | None = None,
    inner: bool = False,
) -> FullRun:
    """One full pass over context + query, recording each block's targets.

    Args:
        traced: the exported model.
        blocks: the blocks to record.
        input_ids: int64 [1, n], context followed by the k query tokens.
        k: number of query tokens at the end of ``input_ids``.
        reference: also compute :attr:`FullRun.reference` (the default forward's head).
        ops: node name -> what computes it instead of its op (see :class:`_Recorder`).
        inner: also record each inner linear's output (:attr:`BlockTargets.inner`; not in an
            MoE block).

    Returns:
        the :class:`FullRun` (targets and logits at the last k positions).
    """
    keep = {b.mlp_in for b in blocks.blocks} | {b.residual_add for b in blocks.blocks}
    keep |= {b.attention.add for b in blocks.blocks if b.attention is not None}
    sites = {
        b.path: [s for s in b.inner if not s.experts] if inner and b.experts is None else []
        for b in blocks.blocks
    }
    keep |= {s.node for found in sites.values() for s in found}
    placer = traced.placer(input_ids)
    rec = _Recorder(traced.graph_module, keep, blocks.head, k, placer, reference, ops)
    with torch.no_grad():
        (logits,) = _as_tuple(rec.run(*traced.placeholder_values(input_ids)))
    targets = {
        b.path: BlockTargets(
            z=rec.kept[b.mlp_in],
            y=rec.kept[b.residual_add],
            v=rec.kept[b.attention.add] if b.attention is not None else None,
            inner={s.module: rec.kept[s.node] for s in sites[b.path]} or None,
        )
        for b in blocks.blocks
    }
    if rec.split:  # [1, 2k, vocab]: the query rows alone, then as the default forward
        query = _last_positions(logits[:, :k], k)
        return FullRun(targets=targets, logits=query, reference=_last_positions(logits, k))
    last = _last_positions(logits, k)  # a head over every row (not a linear): the same values
    return FullRun(targets=targets, logits=last, reference=last if reference else None)


def run_logits(traced: TracedModel, input_ids: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Logits of the unpatched graph on ``input_ids``, last ``k`` positions, float32 [k, vocab]."""
    with torch.no_grad():
        (logits,) = _as_tuple(
            PlacingInterpreter(traced.graph_module, traced.placer(input_ids)).run(
                *traced.placeholder_values(input_ids)
            )
        )
    return _last_positions(logits, k or input_ids.shape[1])


def _as_tuple(out):
    return tuple(out) if isinstance(out, tuple | list) else (out,)
