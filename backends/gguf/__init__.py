"""GGUF for llama.cpp: the patched model and a LoRA GGUF, each run in llama.cpp when it loads."""

from __future__ import annotations

from ctxc.backends.base import Backend
from ctxc.core.vocabulary import LORA_RULE

__all__ = ["DECLARED"]

DECLARED = (
    Backend(
        "gguf",
        writes="model.gguf",
        meaning="a GGUF model for llama.cpp",
        status="writing model.gguf and reloading it with Transformers",
        emitter="ctxc.backends.gguf.model:emit_gguf",
        takes=("tokenizer", "gguf_type"),
        precheck="ctxc.backends.gguf.names:gguf_arch",
    ),
    Backend(
        "gguf-lora",
        writes="lora.gguf",
        meaning="a llama.cpp LoRA GGUF",
        status="writing the llama.cpp LoRA GGUF and checking it",
        emitter="ctxc.backends.gguf.lora:emit_gguf_lora",
        takes=("tokenizer", "gguf_type"),
        precheck="ctxc.backends.gguf.names:gguf_arch",
        rules=(LORA_RULE,),
    ),
)
