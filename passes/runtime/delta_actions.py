"""A delta as an action on a node's output (``apply="lowrank"``, MATH.md 6).

The reduced run adds ``(x v) u^T`` to a linear's output in float32, beside the unchanged
weights, instead of materialising ``W + u v^T``
(:func:`~ctxc.core.delta_math.lowrank_action`);
for a stacked expert bank, each bank row gets its own expert's factors. A vector delta of a post
norm's scale adds ``f * alpha * ds`` to the scaled output, of its bias the vector itself.
Analysis: an action reads the run's values when it is applied and mutates nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import fx

from ctxc.core.delta_math import add_in_float32, lowrank_action
from ctxc.passes.locate.block_map import MlpBlock
from ctxc.patch import Delta

__all__ = ["linear_action", "row_experts", "vector_action"]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Positions as rows: [1, k, d] or [k, d] -> [k, d] (a view)."""
    return x.reshape(-1, x.shape[-1])


def row_experts(value: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Each bank row's expert [rows], int64: the ids node's value, or from a split's chunks.

    Args:
        value: the per-row ids (any shape), or the chunks of ``split_with_sizes`` whose
            chunk ``i`` expert ``i`` maps
            (:func:`~ctxc.passes.locate.match_linears.match_split_bank`).
    """
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).long()
    sizes = torch.tensor([len(c) for c in value], dtype=torch.long)
    return torch.repeat_interleave(torch.arange(len(value)), sizes)


def linear_action(
    delta: Delta, env: dict[fx.Node, torch.Tensor], x_node: fx.Node, ids_node: fx.Node | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The action of ``delta`` (factors ``u``, ``v``) on its linear's output.

    Args:
        delta: a matrix delta; with ``experts``, one factor pair per listed expert.
        env: the run's environment, read when the action is applied.
        x_node: the linear's input node.
        ids_node: for an expert bank, the node holding each bank row's expert.

    Returns:
        ``out -> out + (x v) u^T``, added in float32 and rounded once to ``out``'s dtype.
    """
    u, v = delta.u, delta.v
    assert u is not None and v is not None
    if delta.experts:
        assert ids_node is not None
        slot = {e: i for i, e in enumerate(delta.experts)}

        def bank_act(out: torch.Tensor) -> torch.Tensor:
            x = _rows(env[x_node]).float()  # [rows, in]
            ids = row_experts(env[ids_node]).tolist()
            add = out.new_zeros(out.shape, dtype=torch.float32)  # [rows, out]
            for r, e in enumerate(ids):
                if e in slot:
                    add[r] = lowrank_action(x[r], u[slot[e]], v[slot[e]])  # [out]
            return add_in_float32(out, add)

        return bank_act

    def linear_act(out: torch.Tensor) -> torch.Tensor:
        x = _rows(env[x_node]).float()  # [k, in]
        add = lowrank_action(x, u, v)  # [k, out]
        return add_in_float32(out, add.reshape(out.shape))

    return linear_act


def vector_action(
    delta: Delta, block: MlpBlock, normalized: Callable[[MlpBlock], torch.Tensor]
) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The node a post norm's scale or bias delta acts on, and the action.

    Args:
        delta: a vector delta [d] of the block's scale or bias.
        block: the block whose post norm it changes.
        normalized: ``normalized(block)`` -> the normalised output ``f`` the scale multiplies,
            as the run now computes it.
    """
    vec = delta.vector
    assert vec is not None
    if block.output_control == "bias":
        assert block.norm is not None and block.norm.bias_node is not None
        return block.norm.bias_node, lambda out: add_in_float32(out, vec)
    sc = block.scale
    assert sc is not None

    def scale_act(out: torch.Tensor) -> torch.Tensor:
        f = normalized(block).float().reshape(out.shape)
        return add_in_float32(out, f * (sc.alpha * vec))

    return sc.node, scale_act
