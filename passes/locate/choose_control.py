"""Analysis: which value of a block the output move sets, and what lies between it and ``y``.

MATH.md 2: the output move goes to the post norm's trainable scale when there is one (else its
bias), to the experts' per-token sum for an MoE, else to the outer linear's output. A post norm
with neither a trainable scale nor a bias has a fixed RMS: no patch reaches an arbitrary target
(MATH.md 5), a :class:`Rejection`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ctxc.passes.locate.block_map import Rejection, StepKind, TailStep
from ctxc.passes.locate.follow_tail import Tail, last_norm

__all__ = ["Control", "choose_control"]


@dataclass(frozen=True)
class Control:
    """The output control of a block.

    Attributes:
        kind: ``linear``, ``scale``, ``bias`` or ``experts`` (``MlpBlock.output_control``).
        node: fx node whose value the output move sets.
        tail: the steps from ``node`` to the residual add, as the solver inverts them.
        gain: product of the constant factors on ``tail``.
        stable_ok: the outer linear (or an MoE's per-token sum) feeds an RMS post norm with a
            scale directly, so the stable rule's linear move applies (MATH.md 4).
    """

    kind: str
    node: str
    tail: tuple[TailStep, ...]
    gain: float
    stable_ok: bool


def choose_control(tail: Tail) -> Control | Rejection:
    """The output control of the block that ``tail`` ends.

    Args:
        tail: the main core's tail (the experts' for an MoE).

    Returns:
        the control, or a :class:`Rejection` when the post norm has nothing trainable.
    """
    chain, norm, experts = tail.chain, tail.norm, tail.experts
    if norm is not None:
        if norm.scale is not None and not (norm.centered and norm.bias is not None):
            kind, node = "scale", norm.scale.node
        elif norm.bias is not None and norm.bias_node is not None:
            kind, node = "bias", norm.bias_node
        else:
            centred = "LayerNorm" if norm.centered else "RMS norm"
            reason = (
                f"post norm {norm.module} ({centred}) has no trainable scale or bias: its output "
                "has a fixed RMS, so no patch reaches an arbitrary target (not "
                "output-controllable, MATH.md 5)"
            )
            return Rejection(tail.core.path, reason)
    elif experts is not None:
        kind, node = "experts", experts.combine
    else:
        kind, node = "linear", tail.core.outer.node
    start = next((i + 1 for i, s in enumerate(chain) if s.node == node), 0)
    steps = tuple(s.after_control() for s in chain[start:])
    before_norm = [s for s in chain[: last_norm(chain)] if s.kind != StepKind.COMBINE]
    # The experts' per-token sum feeds the norm as an outer linear's output would: their
    # output move sets it (MATH.md 1, MoE), so an MoE behind a post norm takes the stable rule
    # too (FlexOlmo: the scale alone reached gains of 5e3, MATH.md 12).
    stable_ok = bool(
        norm is not None
        and not norm.centered
        and norm.scale is not None
        and all(s.kind == StepKind.VIEW for s in before_norm)
    )
    gain = math.prod(s.factor for s in steps if s.kind == StepKind.GAIN)
    return Control(kind, node, steps, float(gain), stable_ok)
