"""PEFT and LoRA adapters (``adapter/``, ``lora/``): exact where the rule allows."""

from __future__ import annotations

from ctxc.backends.base import Backend
from ctxc.core.vocabulary import LORA_RULE

__all__ = ["DECLARED", "PEFT"]

PEFT = Backend(
    "peft",
    writes="adapter/",
    meaning="a PEFT adapter",
    status="writing the PEFT adapter and checking it",
    emitter="ctxc.backends.peft.adapter:emit_peft",
    extra="peft",
    requires=("peft",),
    takes=("baked",),
)

DECLARED = (
    PEFT,
    Backend(
        "lora",
        writes="lora/",
        meaning="a serving LoRA adapter (vLLM, SGLang)",
        status="writing the serving LoRA adapter and checking it",
        emitter="ctxc.backends.peft.lora_adapter:emit_lora",
        extra="peft",
        requires=("peft",),
        takes=("baked",),
        rules=(LORA_RULE,),  # linear weights only: no norm scale, bias or expert bank
    ),
)
