"""GGUF for llama.cpp: the patched model and a LoRA GGUF, each run in llama.cpp when it loads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ctxc.backends.base import Backend, Emitter
from ctxc.core.vocabulary import LORA_RULE

__all__ = ["DECLARED"]


def _model() -> Emitter:
    from ctxc.backends.gguf.model import emit_gguf

    return emit_gguf


def _lora() -> Emitter:
    from ctxc.backends.gguf.lora import emit_gguf_lora

    return emit_gguf_lora


def _arch() -> Callable[[Any], object]:
    from ctxc.backends.gguf.names import gguf_arch

    return gguf_arch


DECLARED = (
    Backend(
        "gguf",
        writes="model.gguf",
        meaning="a GGUF model for llama.cpp",
        status="writing model.gguf and reloading it with Transformers",
        emitter=_model,
        takes=("tokenizer", "gguf_type"),
        precheck=_arch,
    ),
    Backend(
        "gguf-lora",
        writes="lora.gguf",
        meaning="a llama.cpp LoRA GGUF",
        status="writing the llama.cpp LoRA GGUF and checking it",
        emitter=_lora,
        takes=("tokenizer", "gguf_type"),
        precheck=_arch,
        rules=(LORA_RULE,),
    ),
)
