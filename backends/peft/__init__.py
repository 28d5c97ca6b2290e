"""PEFT and LoRA adapters (``adapter/``, ``lora/``): exact where the rule allows."""

from __future__ import annotations

from ctxc.backends.base import Backend, Emitter
from ctxc.backends.peft.facts import EXTRA, MAX_LORA_RANKS, NAME, REQUIRES
from ctxc.core.vocabulary import LORA_RULE

__all__ = ["DECLARED", "PEFT"]


def _adapter() -> Emitter:
    from ctxc.backends.peft.adapter import emit_peft

    return emit_peft


def _lora() -> Emitter:
    from ctxc.backends.peft.lora_adapter import emit_lora

    return emit_lora


PEFT = Backend(
    NAME,
    writes="adapter/",
    meaning="a PEFT adapter",
    status="writing the PEFT adapter and checking it",
    emitter=_adapter,
    extra=EXTRA,
    requires=REQUIRES,
    takes=("baked", "bake_report"),
)

DECLARED = (
    PEFT,
    Backend(
        "lora",
        writes="lora/",
        meaning="a serving LoRA adapter (vLLM, SGLang)",
        status="writing the serving LoRA adapter and checking it",
        emitter=_lora,
        extra=EXTRA,
        requires=REQUIRES,
        takes=("baked", "bake_report"),
        rules=(LORA_RULE,),  # linear weights only: no norm scale, bias or expert bank
        # A bake's one rank must be a --max-lora-rank value; past 1, as `ctxc bake --emit lora`
        # has always refused --rank 1 (vLLM itself loads r = 1 at max_lora_rank 1).
        ranks=MAX_LORA_RANKS[1:],
    ),
)
