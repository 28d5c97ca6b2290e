"""The patch as dense weight deltas (``deltas.safetensors``), added to the base model without
ctxc; checked applied so."""

from __future__ import annotations

from ctxc.backends.base import Backend, Emitter

__all__ = ["DECLARED"]


def _emitter() -> Emitter:
    from ctxc.backends.delta.deltas import emit_deltas

    return emit_deltas


DECLARED = (
    Backend(
        "safetensors-delta",
        writes="deltas.safetensors",
        meaning="the patch's weight deltas, dense, to add to the base model",
        status="writing deltas.safetensors and checking it added to the model",
        emitter=_emitter,
        takes=("baked",),
    ),
)
