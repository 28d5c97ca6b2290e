"""ONNX: the patch baked into ``model.onnx``, the patchable model and onnxruntime adapters, each
checked in onnxruntime.
"""

from __future__ import annotations

from ctxc.backends.base import Backend

__all__ = ["DECLARED", "ONNX"]

_REQUIRES = ("onnx", "onnxruntime", "onnxscript")

ONNX = Backend(
    "onnx",
    writes="model.onnx",
    meaning="an ONNX model checked in onnxruntime",
    status="exporting model.onnx and checking it with onnxruntime",
    emitter="ctxc.backends.onnx.model:emit_onnx",
    patchable="ctxc.backends.onnx.patchable:emit_onnx_patchable",
    extra="onnx",
    requires=_REQUIRES,
)

DECLARED = (
    ONNX,
    Backend(
        "ort-adapter",
        writes="context.onnx_adapter",
        meaning="an onnxruntime LoRA adapter (and patchable.onnx)",
        status="writing the onnxruntime adapter (and patchable.onnx) and checking it",
        emitter="ctxc.backends.onnx.ort_adapter:emit_ort_adapter",
        extra="onnx",
        requires=_REQUIRES,
        also=("context.onnx_adapter.json", "patchable.onnx"),  # its record, its graph
    ),
)
