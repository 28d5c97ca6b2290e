"""The compile report: fidelity beside the unpatched control, per-block figures, timings."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ctxc.core.block_stats import BlockStats
from ctxc.core.metrics import Fidelity, top1_word
from ctxc.core.vocabulary import LORA_RULE, REPORT_FILE

if TYPE_CHECKING:
    from ctxc.core.checks import ArtefactError

__all__ = ["REPORT_FILE", "SOLVER_REFERENCE", "CompileReport", "reference_name", "write_report"]

# What the solver's figure is measured against: its own arithmetic.
SOLVER_REFERENCE = (
    "ctxc's full run of the traced graph on context + query, its head over the query rows "
    "alone as the solver's reduced run applies it"
)


def reference_name(model, images: bool = False) -> str:
    """What the emitted and control figures are measured against, in words: the runtime (its
    version), the model's class, its attention implementation, the input and which logits.

    Args:
        model: the model compiled on (its class and config).
        images: the context holds images (the input is the processor's).
    """
    import transformers

    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None) or "default"
    what = "the processor's images + text + query" if images else "context + query"
    return (
        f"transformers {transformers.__version__} {type(model).__name__} forward, {attn} "
        f"attention (the model's default), on {what}; logits of every position (the default "
        "logits_to_keep=0), read at the query positions"
    )


@dataclass(frozen=True)
class CompileReport:
    """Everything ``report.json`` holds.

    Attributes:
        model: the model spec it was compiled on.
        dtype: the model's dtype.
        update: update rule.
        start_layer: first patched block.
        context_ids, query_ids: the token ids.
        patched: the solver's reduced pass against ctxc's full run with the same head
            arithmetic (:data:`SOLVER_REFERENCE`): the solver's own figure (``solver``).
        emitted: the model with the patch applied (eager Transformers), fed the query alone,
            against ``reference``.
        control: the unpatched model (eager Transformers) fed the query alone, against
            ``reference``.
        blocks: per-block figures.
        rejections: ``"path: reason"`` for every candidate block left unpatched.
        timings: seconds per stage.
        frontend: the export ladder's rung: ``dynamic``, ``bounded`` or ``static``
            (``compiler/frontend/ladder.py``).
        images: for an image context, what ``compiler/runs/image_run.py`` reports (the images,
            the image token count, the full run against the model's own forward); else None.
        device: the device the runs started on (the input embedding's).
        placement: parameters per device (``disk``: offloaded), ``compiler/models/devices.py``.
        floor: the reference's own runtime with the head over the query rows alone (as
            ``logits_to_keep=k`` and ``generate`` compute them) against ``reference``: what the
            runtime differs from itself by: the rounding scale of any model fed the query alone,
            not a bound (an artefact's rounding can land closer).
        reference: what ``emitted``, ``control`` and ``floor`` are measured against
            (:func:`reference_name`).
        chat: for a chat context, how the chat template split the conversation
            (``ctxc.core.chat.ChatSplit.to_dict``: the rendered query text the patched model
            must be fed, as ``query_ids``); else None.
    """

    model: str
    dtype: str
    update: str
    start_layer: int
    context_ids: list[int]
    query_ids: list[int]
    patched: Fidelity
    emitted: Fidelity
    control: Fidelity
    blocks: tuple[BlockStats, ...]
    rejections: tuple[str, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)
    ctxc_version: str = ""
    apply: str = "baked"
    frontend: str = "dynamic"
    images: dict | None = None
    device: str = "cpu"
    placement: dict[str, int] = field(default_factory=dict)
    floor: Fidelity | None = None
    reference: str = ""
    chat: dict | None = None

    @property
    def rounding_gain(self) -> float | None:
        """The largest block's ``rounding_gain`` (MATH.md 12), or None when no block has one."""
        gains = [b.rounding_gain for b in self.blocks if b.rounding_gain is not None]
        return max(gains) if gains else None

    @property
    def max_abs_logit_diff(self) -> float:
        return self.emitted.max_abs_logit_diff

    def to_dict(self) -> dict:
        """The JSON form; top-level figures are the emitted model's."""
        e = self.emitted
        out = {
            "ctxc_version": self.ctxc_version,
            "model": self.model,
            "dtype": self.dtype,
            "update": self.update,
            "apply": self.apply,
            "frontend": self.frontend,
            "device": self.device,
            "placement": self.placement,
            "start_layer": self.start_layer,
            "context_ids": self.context_ids,
            "query_ids": self.query_ids,
            "max_abs_logit_diff": e.max_abs_logit_diff,
            "mean_abs_logit_diff": e.mean_abs_logit_diff,
            "total_variation": e.total_variation,
            "top1_match": e.top1_match,
            "reference": self.reference,
            "emitted": {**e.to_dict(), "reference": self.reference},
            "solver": {**self.patched.to_dict(), "reference": SOLVER_REFERENCE},
            "control": {**self.control.to_dict(), "reference": self.reference},
            # The largest block's first-order rounding gain (MATH.md 12): what predicts the
            # patched model's fidelity in another arithmetic (a reload, onnxruntime).
            "rounding_gain": self.rounding_gain,
            "blocks": [_clean(asdict(b)) for b in self.blocks],
            "rejections": list(self.rejections),
            "timings": self.timings,
        }
        if self.floor is not None:
            out["runtime_floor"] = {
                **self.floor.to_dict(),
                "reference": self.reference,
                "measured": "the same runtime, the head over the query rows alone "
                "(logits_to_keep=k, as generate computes them)",
            }
        if self.images is not None:
            out["images"] = self.images
        if self.chat is not None:
            out["chat"] = self.chat
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self, decode=None) -> str:
        """A few lines for a terminal or a log.

        Args:
            decode: the tokenizer's ``decode`` (token ids -> text): the top-1 tokens are shown
                beside their ids, ``107 ' the'``; None: the ids alone.
        """
        e, c = self.emitted, self.control

        def token(i: int) -> str:
            return f"{i} {decode([i])!r}" if decode is not None else str(i)

        patched = sum(b.patched for b in self.blocks)
        lines = [
            f"{patched}/{len(self.blocks)} blocks patched ({self.update} rule, {self.dtype}); "
            f"context {len(self.context_ids)} tokens, query {len(self.query_ids)}",
            f"max |logit diff| {e.max_abs_logit_diff:.3g} (unpatched: {c.max_abs_logit_diff:.3g})"
            f"   total variation {e.total_variation:.3g} (unpatched: {c.total_variation:.3g})",
            f"top-1 {top1_word(e.top1_match)} ({token(e.top1)} vs full "
            f"{token(e.top1_full)}; "
            f"unpatched {top1_word(c.top1_match, loud=False)})",
        ]
        if self.floor is not None:
            floor, solver = self.floor.max_abs_logit_diff, self.patched.max_abs_logit_diff
            lines.append(
                "reference: the model's own Transformers forward on context + query (its floor "
                f"{floor:.3g}; solver {solver:.3g})"
            )
        if self.chat is not None:
            lines.append(f"chat: feed the patched model the query turn {self.chat['query_text']!r}")
        if self.update == LORA_RULE and (missed := self._lora_misses()):
            lines.append(missed)
        if self.rejections:
            lines.append(
                f"{len(self.rejections)} block(s) left unpatched: " + "; ".join(self.rejections)
            )
        return "\n".join(lines)

    def _lora_misses(self) -> str:
        """One line on the ``lora`` rule's blocks left off their target, or ``""``."""
        far = [b for b in self.blocks if (b.reach_gap or 0.0) > 0.0]
        one = [
            b
            for b in self.blocks
            if b.patched and b.reach_gap is None and b.output_control in ("scale", "bias")
        ]
        return _lora_line(far, one) if far or one else ""


def _lora_line(far: list, one: list) -> str:
    """The ``lora`` rule's blocks that linear weights could not bring to their target."""
    parts = []
    if far:
        worst = max(far, key=lambda b: b.reach_gap)
        parts.append(
            f"{len(far)} block(s) out of reach of o_proj and down_proj (largest gap "
            f"{worst.reach_gap:.3g} at {worst.path})"
        )
    if one:
        worst = max(one, key=lambda b: b.unreached_norm or 0.0)
        parts.append(
            f"{len(one)} block(s) behind a post norm with no second linear surface (largest "
            f"miss {worst.unreached_norm or 0.0:.3g} at {worst.path})"
        )
    return "lora: " + "; ".join(parts) + ": the blocks above absorbed what they could (MATH.md 10)"


def _clean(d: dict) -> dict:
    # JSON has no NaN: figures that do not apply to a block are null.
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def write_report(
    folder: Path,
    head: Mapping,
    artefacts: Mapping | None = None,
    failed: ArtefactError | None = None,
    under: str | None = None,
) -> dict:
    """Write ``folder/report.json``, the one writer of every command's report.

    Args:
        folder: the output (staging) folder.
        head: the command's own figures, first (a compile's :meth:`CompileReport.to_dict`).
        artefacts: each emitted artefact's figures by ``--emit`` kind (objects with
            ``to_dict``, or dicts), at the top level or under ``under``.
        failed: the artefact error that stopped the run: recorded under ``"failed"``.
        under: the key that holds the artefacts' figures (``ctxc bake``: ``"artefacts"``).

    Returns:
        the data written (indented JSON, one trailing newline).
    """
    data = dict(head)
    figures = {
        kind: f if isinstance(f, Mapping) else f.to_dict() for kind, f in (artefacts or {}).items()
    }
    if under is None:
        data.update(figures)
    else:
        data[under] = figures
    if failed is not None:
        data["failed"] = {"artefact": failed.artefact, "error": str(failed)}
    (folder / REPORT_FILE).write_text(json.dumps(data, indent=2) + "\n")
    return data
