"""ONNX: the patch baked into ``model.onnx``, the patchable model and onnxruntime adapters, each
checked in onnxruntime.
"""

from __future__ import annotations

from ctxc.backends.base import Backend, Emitter
from ctxc.backends.onnx.facts import EXTRA, NAME, REQUIRES

__all__ = ["DECLARED", "ONNX"]


def _model() -> Emitter:
    from ctxc.backends.onnx.model import emit_onnx

    return emit_onnx


def _patchable() -> Emitter:
    from ctxc.backends.onnx.patchable import emit_onnx_patchable

    return emit_onnx_patchable


def _adapter() -> Emitter:
    from ctxc.backends.onnx.ort_adapter import emit_ort_adapter

    return emit_ort_adapter


ONNX = Backend(
    NAME,
    writes="model.onnx",
    meaning="an ONNX model checked in onnxruntime",
    status="exporting model.onnx and checking it with onnxruntime",
    emitter=_model,
    patchable=_patchable,
    extra=EXTRA,
    requires=REQUIRES,
)

DECLARED = (
    ONNX,
    Backend(
        "ort-adapter",
        writes="context.onnx_adapter",
        meaning="an onnxruntime LoRA adapter (and patchable.onnx)",
        status="writing the onnxruntime adapter (and patchable.onnx) and checking it",
        emitter=_adapter,
        extra=EXTRA,
        requires=REQUIRES,
        also=("context.onnx_adapter.json", "patchable.onnx"),  # its record, its graph
    ),
)
