"""A matrix delta as an action on its linear's output (``apply="lowrank"``, MATH.md 6).

The reduced run adds ``(x v) u^T`` to the linear's output in float32, beside the unchanged
weights, instead of materialising ``W + u v^T`` (:func:`~ctxc.passes.delta_math.lowrank_action`).
For a stacked expert bank, each bank row gets its own expert's factors. Analysis: the action
reads the run's environment when it is applied and mutates nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from ctxc.passes.delta_math import add_in_float32, lowrank_action
from ctxc.patch import Delta

__all__ = ["linear_action"]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Positions as rows: [1, k, d] or [k, d] -> [k, d] (a view)."""
    return x.reshape(-1, x.shape[-1])


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
            ids = env[ids_node].reshape(-1).tolist()
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
