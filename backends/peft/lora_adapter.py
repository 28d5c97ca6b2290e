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

from ctxc.backends.peft.adapter import PeftFigures, emit_peft
from ctxc.backends.peft.lora_rules import VllmCheck, check_vllm_adapter
from ctxc.core.errors import CtxcError
from ctxc.core.metrics import top1_word
from ctxc.patch import Delta, Patch

__all__ = ["LORA_DIR", "LoraFigures", "emit_lora", "refuse_unservable", "servable_deltas"]

LORA_DIR = "lora"


@dataclass(frozen=True)
class LoraFigures:
    """The serving adapter's PEFT figures and its vLLM check."""

    peft: PeftFigures
    vllm: VllmCheck

    def to_dict(self) -> dict:
        """The JSON form written under ``"lora"`` in ``report.json``."""
        return asdict(self)

    def summary(self) -> str:
        """One line for a terminal."""
        a = self.peft.lora
        return (
            f"lora: {LORA_DIR}/ ({self.vllm.modules} modules, r={self.vllm.r}, vLLM "
            f"--max-lora-rank {self.vllm.max_lora_rank}, vLLM rules checked structurally); "
            f"as loaded vs full context max {a.max_abs_logit_diff:.3g}, top-1 "
            f"{top1_word(a.top1_match)}"
        )


def refuse_unservable(patch: Patch, what: str) -> None:
    """Refuse a patch with a norm-scale, bias or expert-bank delta, from the patch alone (no
    model: ``ctxc export`` says so before the model loads).

    Raises:
        CtxcError: one line naming the first such parameter and the rule to use.
    """
    for name, delta in patch.deltas.items():
        if delta.vector is not None or delta.experts or not name.endswith(".weight"):
            kind = "an expert bank" if delta.experts else "a norm scale or bias"
            raise CtxcError(
                f"{what} holds linear weights only; this patch changes {name} ({kind}, from "
                f"--update {patch.meta.update}): compile with --update lora"
            )


def servable_deltas(model: torch.nn.Module, patch: Patch, what: str) -> dict[str, Delta]:
    """The patch's deltas by module, when every one is a serving engine's LoRA pair.

    Args:
        model: the model the patch applies to.
        patch: the patch.
        what: the artefact, for the message (``--emit lora``).

    Returns:
        module name -> its weight's delta (all of one rank).

    Raises:
        CtxcError: a norm scale, bias or expert-bank delta, a delta of a module that is not a
            ``nn.Linear``, or mixed ranks: one line that names the rule to use.
    """
    refuse_unservable(patch, what)
    found: dict[str, Delta] = {}
    for name, delta in patch.deltas.items():
        module = name.rpartition(".")[0]
        layer = model.get_submodule(module)
        if not isinstance(layer, torch.nn.Linear) or delta.layout != "out_in":
            raise CtxcError(f"{what} holds nn.Linear weights only; {name} is not one")
        found[module] = delta
    ranks = {d.rank for d in found.values()}
    if len(ranks) > 1:
        raise CtxcError(f"{what} needs one rank for every module; this patch has {sorted(ranks)}")
    if not found:
        raise CtxcError(f"{what}: the patch changes no weight")
    return found


def emit_lora(
    model: torch.nn.Module,
    patch: Patch,
    out: Path,
    *,
    full: torch.Tensor | None = None,
    baked: torch.Tensor | None = None,
) -> tuple[Path, LoraFigures]:
    """Write ``out/lora/`` (PEFT format, vLLM's rules) and check it.

    Args:
        model: the model the patch was computed on (not modified).
        patch: a patch of linear deltas of one rank (``--update lora``).
        out: the output folder.
        full: the full-context logits at the query positions [k, vocab], if computed.
        baked: the patched model's logits on the query, if computed (``emit_peft``).

    Returns:
        the folder and its :class:`LoraFigures`.

    Raises:
        CtxcError: the patch has deltas LoRA cannot serve, or the adapter fails a check.
    """
    servable_deltas(model, patch, "--emit lora")
    path, peft = emit_peft(model, patch, out, full=full, dirname=LORA_DIR, baked=baked)
    return path, LoraFigures(peft=peft, vllm=check_vllm_adapter(path, model))
