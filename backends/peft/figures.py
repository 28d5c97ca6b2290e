"""The PEFT adapter's figures: what it holds, and each comparison beside the bound that applies to
it (``report.json``'s ``peft``: ``vs_full_context``, ``vs_patched``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ctxc.core.metrics import Fidelity, top1_word
from ctxc.models.identity import BaseIdentity

__all__ = ["FULL_CONTEXT", "PATCHED", "Against", "PeftFigures"]

# What each comparison of the figures compares, as report.json says it.
FULL_CONTEXT = (
    "the adapter on the base model fed the query alone, against the base model fed context + query"
)
PATCHED = (
    "the adapter on the base model against ctxc's patched model (the patch's weights in torch), "
    "both fed the query: how faithfully the adapter carries the patch"
)


@dataclass(frozen=True)
class Against:
    """One comparison's figure and the bound that applies to it.

    Attributes:
        max_abs_logit_diff: ``max |logits|`` difference over the query positions.
        bound: what it was checked against; None: reported, not bounded (the note says why).
    """

    max_abs_logit_diff: float
    bound: float | None


@dataclass(frozen=True)
class PeftFigures:
    """What the adapter holds and how well PEFT reproduces the full-context model with it.

    Attributes:
        dir: the adapter folder, relative to the output folder.
        lora_modules: number of LoRA target modules (linear layers).
        lora_parameters: number of LoRA target parameters (stacked expert banks).
        r: LoRA's ``r`` (= ``lora_alpha``).
        rank_pattern: module -> rank where it differs from ``r``.
        modules_to_save: modules stored whole with their patched values.
        lora: ``PeftModel.from_pretrained`` as loaded, fed the query, against the full context.
        merged: the same after ``merge_and_unload()``.
        full_context_bound: the bound the emit loop holds ``lora`` and ``merged`` to (the
            patch's own figure plus the runtime's slack, ``ctxc.core.checks.gate``); None for a
            patch that is not exact (a bake): reported, not bounded.
        as_loaded_vs_patched: the adapter as loaded against the torch patched model (reported,
            not bounded: LoRA's unmerged arithmetic, the note).
        merged_vs_patched: the same after merging, checked against its bound.
        note: what the adapter format does not reproduce exactly, and why.
        seconds: wall time of writing and checking.
        saved_whole: the classes of the ``modules_to_save`` modules, with their counts
            (``{"Gemma3RMSNorm": 18}``: the post-norm scales).
        base: the base model's identity (what ``adapter_config.json`` and the card name).
    """

    dir: str
    lora_modules: int
    lora_parameters: int
    r: int
    rank_pattern: dict[str, int]
    modules_to_save: tuple[str, ...]
    lora: Fidelity
    merged: Fidelity
    full_context_bound: float | None
    as_loaded_vs_patched: Against
    merged_vs_patched: Against
    note: str
    seconds: float
    saved_whole: dict[str, int] = field(default_factory=dict)
    base: BaseIdentity | None = None

    def to_dict(self) -> dict:
        """The JSON form written under ``"peft"`` in ``report.json``: each figure under what it
        compares (``vs_full_context``, ``vs_patched``), beside the bound that applies to it."""
        return {
            "dir": self.dir,
            "lora_modules": self.lora_modules,
            "lora_parameters": self.lora_parameters,
            "r": self.r,
            "rank_pattern": self.rank_pattern,
            "modules_to_save": list(self.modules_to_save),
            "saved_whole": self.saved_whole,
            "base_model": self.base.to_dict() if self.base is not None else None,
            "vs_full_context": {
                "compares": FULL_CONTEXT,
                "bound": self.full_context_bound,
                "as_loaded": self.lora.to_dict(),
                "merged": self.merged.to_dict(),
            },
            "vs_patched": {
                "compares": PATCHED,
                "as_loaded": asdict(self.as_loaded_vs_patched),
                "merged": asdict(self.merged_vs_patched),
            },
            "note": self.note,
            "seconds": self.seconds,
        }

    def fidelities(self) -> dict[str, Fidelity]:
        """The adapter as loaded and merged, each held to the patch's figure by the gate."""
        return {"lora": self.lora, "merged": self.merged}

    def summary(self) -> str:
        """One line for a terminal or a log: what the adapter holds, and its figures."""
        a, m = self.lora, self.merged
        return (
            f"peft: {self.dir}/ holds {self.holds()}; vs full context max "
            f"{a.max_abs_logit_diff:.3g} as loaded, {m.max_abs_logit_diff:.3g} merged, top-1 "
            f"{top1_word(a.top1_match and m.top1_match)}"
        )

    def holds(self) -> str:
        """``54 LoRA pairs (r=1) and 18 modules stored whole (modules_to_save: 18
        Gemma3RMSNorm)``: the adapter's content in words."""
        parts = [f"{self.lora_modules} LoRA pairs (r={self.r})"]
        if self.lora_parameters:
            parts.append(f"{self.lora_parameters} expert banks as LoRA target_parameters")
        if self.modules_to_save:
            kinds = ", ".join(f"{n} {k}" for k, n in self.saved_whole.items())
            parts.append(
                f"{len(self.modules_to_save)} modules stored whole with their patched values "
                f"(modules_to_save{': ' + kinds if kinds else ''})"
            )
        return " and ".join(parts)
