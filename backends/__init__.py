"""Emitters: patched Transformers model, ONNX, PEFT adapter."""

from __future__ import annotations

__all__: list[str] = []
