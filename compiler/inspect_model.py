"""``ctxc inspect``: what the analyses find in a model, as text or stable JSON."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ctxc.passes.block_map import BlockMap, MlpBlock
from ctxc.passes.classify import classify
from ctxc.passes.graph_view import GraphView, op_name

__all__ = ["ModelInspection", "inspect_model"]


@dataclass(frozen=True)
class ModelInspection:
    """Per-block findings of a model. JSON uses module paths and op kinds, never fx node names."""

    model: str
    model_class: str
    blocks: tuple[dict, ...]
    rejections: tuple[dict, ...]

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "model_class": self.model_class,
            "summary": {
                "blocks": len(self.blocks) + len(self.rejections),
                "patchable": len(self.blocks),
                "rejected": len(self.rejections),
                "patched_params": sum(len(b["patched"]) for b in self.blocks),
            },
            "blocks": list(self.blocks),
            "rejections": list(self.rejections),
        }

    def to_text(self) -> str:
        d = self.to_dict()["summary"]
        lines = [
            f"{self.model_class} ({self.model or 'model'}): {d['patchable']} patchable block(s), "
            f"{d['rejected']} rejected, {d['patched_params']} parameters patched"
        ]
        for b in self.blocks:
            parts = ", ".join(f"{p['param']} ({p['move']}, {p['kind']})" for p in b["patched"])
            lines.append(f"  {b['path']}: {b['shape']}; patches {parts}")
        for r in self.rejections:
            lines.append(f"  {r['path']}: REJECTED: {r['reason']}")
        return "\n".join(lines)


def _block_info(view: GraphView, b: MlpBlock, roles) -> dict:
    inner = [
        {
            "param": s.weight,
            "module": s.module,
            "op": op_name(view.by_name[s.node]),
            "control": roles[s.node].control,
        }
        for s in b.inner
    ]
    patched = [{"param": s.weight, "move": "input", "kind": "rank-k matrix"} for s in b.inner]
    if b.output_control == "scale":
        assert b.scale is not None
        patched.append({"param": b.scale.param, "move": "output", "kind": "vector"})
    patched.append(
        {
            "param": b.outer.weight,
            "move": "output",
            "kind": "rank-k matrix",
            "rules": ["stable"] if b.output_control == "scale" else ["standard", "stable"],
        }
    )
    gated = len(b.inner) > 1
    shape = (
        ("gated" if gated else "plain")
        + " MLP"
        + (
            f", post norm {b.post_norm} with scale (1 x {b.scale.alpha:g} w + {b.scale.offset:g})"
            if b.scale is not None
            else ""
        )
    )
    return {
        "path": b.path,
        "shape": shape,
        "output_control": b.output_control,
        "gain": b.gain,
        "inner": inner,
        "outer": {
            "param": b.outer.weight,
            "module": b.outer.module,
            "op": op_name(view.by_name[b.outer.node]),
            "layout": b.outer.layout,
        },
        "post_norm": b.post_norm,
        "scale": None
        if b.scale is None
        else {"param": b.scale.param, "alpha": b.scale.alpha, "offset": b.scale.offset},
        "patched": patched,
    }


def inspect_model(model: torch.nn.Module) -> ModelInspection:
    """Trace ``model`` (or reuse its trace) and describe every block it finds."""
    from ctxc.pipeline import traced_blocks

    traced, blocks = traced_blocks(model)
    return describe(model, traced, blocks)


def describe(model, traced, blocks: BlockMap) -> ModelInspection:
    view = GraphView(traced)
    roles = classify(blocks)
    return ModelInspection(
        model=str(getattr(model, "ctxc_name", "")),
        model_class=type(model).__name__,
        blocks=tuple(_block_info(view, b, roles) for b in blocks.blocks),
        rejections=tuple({"path": r.where, "reason": r.reason} for r in blocks.rejections),
    )
