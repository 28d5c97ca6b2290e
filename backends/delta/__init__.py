"""The patch as dense weight deltas (``deltas.safetensors``), added to the base model without
ctxc; checked applied so."""

from __future__ import annotations

from ctxc.backends.base import Backend

__all__ = ["DECLARED"]

DECLARED = (
    Backend(
        "safetensors-delta",
        writes="deltas.safetensors",
        meaning="the patch's weight deltas, dense, to add to the base model",
        status="writing deltas.safetensors and checking it added to the model",
        emitter="ctxc.backends.delta.deltas:emit_deltas",
        takes=("baked",),
    ),
)
