"""The compile report: fidelity beside the unpatched control, per-block figures, timings."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from ctxc.metrics import Fidelity
from ctxc.passes.block_stats import BlockStats

__all__ = ["CompileReport"]


@dataclass(frozen=True)
class CompileReport:
    """Everything ``report.json`` holds.

    Attributes:
        model: the model spec it was compiled on.
        dtype: the model's dtype.
        update: update rule.
        start_layer: first patched block.
        context_ids, query_ids: the token ids.
        patched: the solver's reduced pass against the full-context logits.
        emitted: the model with the patch applied (eager Transformers), fed the query alone.
        control: the unpatched model fed the query alone.
        blocks: per-block figures.
        rejections: ``"path: reason"`` for every candidate block left unpatched.
        timings: seconds per stage.
        frontend: the export ladder's rung: ``dynamic``, ``bounded`` or ``static``
            (``compiler/frontend.py``).
        images: for an image context, what ``compiler/image_run.py`` reports (the images,
            the image token count, the full run against the model's own forward); else None.
        device: the device the runs started on (the input embedding's).
        placement: parameters per device (``disk``: offloaded), ``compiler/devices.py``.
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
            "emitted": e.to_dict(),
            "solver": self.patched.to_dict(),
            "control": self.control.to_dict(),
            # The largest block's first-order rounding gain (MATH.md 12): what predicts the
            # patched model's fidelity in another arithmetic (a reload, onnxruntime).
            "rounding_gain": self.rounding_gain,
            "blocks": [_clean(asdict(b)) for b in self.blocks],
            "rejections": list(self.rejections),
            "timings": self.timings,
        }
        if self.images is not None:
            out["images"] = self.images
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def summary(self) -> str:
        """A few lines for a terminal."""
        e, c = self.emitted, self.control
        patched = sum(b.patched for b in self.blocks)
        lines = [
            f"{patched}/{len(self.blocks)} blocks patched ({self.update} rule, {self.dtype}); "
            f"context {len(self.context_ids)} tokens, query {len(self.query_ids)}",
            f"max |logit diff| {e.max_abs_logit_diff:.3g} (unpatched: {c.max_abs_logit_diff:.3g})"
            f"   total variation {e.total_variation:.3g} (unpatched: {c.total_variation:.3g})",
            f"top-1 {'match' if e.top1_match else 'MISMATCH'} ({e.top1} vs full {e.top1_full}; "
            f"unpatched {'match' if c.top1_match else 'mismatch'})",
        ]
        if self.rejections:
            lines.append(
                f"{len(self.rejections)} block(s) left unpatched: " + "; ".join(self.rejections)
            )
        return "\n".join(lines)


def _clean(d: dict) -> dict:
    # JSON has no NaN: figures that do not apply to a block are null.
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}
