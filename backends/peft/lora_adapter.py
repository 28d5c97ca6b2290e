"""Serving LoRA backend (``--emit lora``): a PEFT adapter that vLLM can load.

Linear weight deltas only, every one the same rank, no ``modules_to_save`` and no biases:
the patch must come from ``--update lora`` (or have no norm, bias or expert-bank delta). The
adapter is written and checked by the PEFT backend (loaded back, merged, compared with the
torch patched model) into ``DIR/lora/``, then checked against vLLM's adapter rules
(:mod:`lora_rules`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ctxc.backends.lora_pairs import servable_deltas
from ctxc.backends.peft.adapter import emit_peft
from ctxc.backends.peft.figures import PeftFigures
from ctxc.backends.peft.lora_rules import VllmCheck, check_vllm_adapter
from ctxc.core.metrics import Fidelity, top1_word
from ctxc.patch import Patch

__all__ = ["LORA_DIR", "LoraFigures", "emit_lora"]

LORA_DIR = "lora"


@dataclass(frozen=True)
class LoraFigures:
    """The serving adapter's PEFT figures and its vLLM check."""

    peft: PeftFigures
    vllm: VllmCheck

    def to_dict(self) -> dict:
        """The JSON form written under ``"lora"`` in ``report.json``."""
        return {"peft": self.peft.to_dict(), "vllm": asdict(self.vllm)}

    def fidelities(self) -> dict[str, Fidelity]:
        """As the PEFT adapter's: as loaded and merged, each held to the patch's figure."""
        return self.peft.fidelities()

    def summary(self) -> str:
        """One line for a terminal."""
        a = self.peft.lora
        return (
            f"lora: {LORA_DIR}/ ({self.vllm.modules} modules, r={self.vllm.r}, vLLM "
            f"--max-lora-rank {self.vllm.max_lora_rank}, vLLM rules checked structurally); "
            f"as loaded vs full context max {a.max_abs_logit_diff:.3g}, top-1 "
            f"{top1_word(a.top1_match)}"
        )


def emit_lora(
    model: torch.nn.Module,
    patch: Patch,
    out: Path,
    *,
    full: torch.Tensor | None = None,
    baked: torch.Tensor | None = None,
    bake_report: dict | None = None,
) -> tuple[Path, LoraFigures]:
    """Write ``out/lora/`` (PEFT format, vLLM's rules) and check it.

    Args:
        model: the model the patch was computed on (not modified).
        patch: a patch of linear deltas of one rank (``--update lora``).
        out: the output folder.
        full: the full-context logits at the query positions [k, vocab], if computed.
        baked: the patched model's logits on the query, if computed (``emit_peft``).
        bake_report: a baked patch's report, for the adapter's card (``emit_peft``).

    Returns:
        the folder and its :class:`LoraFigures`.

    Raises:
        CtxcError: the patch has deltas LoRA cannot serve, or the adapter fails a check.
    """
    servable_deltas(model, patch, "--emit lora")
    path, peft = emit_peft(
        model, patch, out, full=full, dirname=LORA_DIR, baked=baked, bake_report=bake_report
    )
    return path, LoraFigures(peft=peft, vllm=check_vllm_adapter(path, model))
