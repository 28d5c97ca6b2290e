"""Interpreting the traced graph: a plain run, and a recording run over the full input.

Both runs walk the exported graph with ``torch.fx.Interpreter``, so they compute exactly the ops
the solver's reduced run computes. The recording run keeps, per block and at the query positions
only, the targets of MATH.md 3: the MLP input ``z_C`` and the block output ``y_C``. It frees
each value after its last use, applies the head to the query rows only, and computes attention
under a boolean mask on the key blocks each query chunk can see (``banded_attention``: the same
bits, a fraction of the scores at long contexts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ctxc.passes.banded_attention import Band, banded_sdpa, mask_bands, sdpa_call, usable
from ctxc.passes.block_map import BlockMap
from ctxc.passes.placement import Placer, PlacingInterpreter
from ctxc.trace import TracedModel

__all__ = ["BlockTargets", "FullRun", "record_targets", "run_logits"]

aten = torch.ops.aten


@dataclass(frozen=True)
class BlockTargets:
    """The full run's values at the query positions for one block.

    Attributes:
        z: MLP input ``z_C`` [k, d_in], in the model's dtype.
        y: block output ``y_C`` [k, d_model], in the model's dtype.
    """

    z: torch.Tensor
    y: torch.Tensor


@dataclass(frozen=True)
class FullRun:
    """Targets of every block and the full-context logits at the query positions.

    Attributes:
        targets: block path -> :class:`BlockTargets`.
        logits: [k, vocab], float32.
    """

    targets: dict[str, BlockTargets]
    logits: torch.Tensor


class _Recorder(PlacingInterpreter):
    """Runs the graph, keeping the last ``k`` positions of chosen nodes."""

    def __init__(
        self, gm: fx.GraphModule, keep: set[str], head: str | None, k: int, placer: Placer | None
    ) -> None:
        super().__init__(gm, placer, garbage_collect_values=True)
        self.keep, self.head, self.k = keep, head, k
        self.kept: dict[str, torch.Tensor] = {}
        self.bands: dict[fx.Node, tuple[Band, ...]] = {}  # attention mask node -> its bands

    def run_node(self, n: fx.Node):
        if n.name == self.head and n.target == aten.linear.default:
            # Only the query positions' logits are needed: apply the head to those rows.
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            x = args[0][..., -self.k :, :]  # [1, k, d]
            return self.call_function(n.target, (x, *args[1:]), kwargs)
        if n.target is aten.scaled_dot_product_attention.default:
            out = self._banded(n)
            if out is not None:
                return out
        out = super().run_node(n)
        if n.name in self.keep:
            # Rows are positions whatever the layout ([1, n, d], or [n, d] for OPT and Conv1D).
            self.kept[n.name] = out.reshape(-1, out.shape[-1])[-self.k :].detach().clone()  # [k, d]
        return out

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
        if node not in self.bands:  # masks are shared by many layers: scan each once
            self.bands[node] = mask_bands(mask)
        extra = {"enable_gqa": call["enable_gqa"]} if "enable_gqa" in call else {}
        return banded_sdpa(
            q, call["key"], call["value"], mask, self.bands[node], call["scale"], **extra
        )


def _last_positions(logits: torch.Tensor, k: int) -> torch.Tensor:
    return logits[0, -k:].float()  # [k, vocab]


def record_targets(
    traced: TracedModel, blocks: BlockMap, input_ids: torch.Tensor, k: int
) -> FullRun:
    """One full pass over context + query, recording each block's targets.

    Args:
        traced: the exported model.
        blocks: the blocks to record.
        input_ids: int64 [1, n], context followed by the k query tokens.
        k: number of query tokens at the end of ``input_ids``.

    Returns:
        the :class:`FullRun` (targets and logits at the last k positions).
    """
    keep = {b.mlp_in for b in blocks.blocks} | {b.residual_add for b in blocks.blocks}
    rec = _Recorder(traced.graph_module, keep, blocks.head, k, traced.placer(input_ids))
    with torch.no_grad():
        (logits,) = _as_tuple(rec.run(*traced.placeholder_values(input_ids)))
    targets = {
        b.path: BlockTargets(z=rec.kept[b.mlp_in], y=rec.kept[b.residual_add])
        for b in blocks.blocks
    }
    return FullRun(targets=targets, logits=_last_positions(logits, k))


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
