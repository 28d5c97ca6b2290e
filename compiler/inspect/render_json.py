"""Renderer: an inspection as a stable JSON document (module paths and op kinds only)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the model's methods call this module: no import cycle at run time
    from ctxc.inspect.analysis import BlockInspection, ModelInspection, Part, PatchEntry, TailEntry

__all__ = ["inspection_dict", "render_json"]


def render_json(info: ModelInspection) -> str:
    """The JSON document.

    Args:
        info: the inspection.

    Returns:
        JSON indented by two spaces, with a final newline (the golden files' bytes).
    """
    return json.dumps(inspection_dict(info), indent=2) + "\n"


def inspection_dict(info: ModelInspection) -> dict[str, Any]:
    """The JSON document as Python data, keys in their documented order.

    Args:
        info: the inspection.

    Returns:
        ``model``, ``model_class``, ``lm_head``, ``summary``, ``blocks``, ``rejections``,
        and ``notes`` when there are any.
    """
    s = info.summary()
    summary = {
        "blocks": s.blocks,
        "patchable": s.patchable,
        "rejected": s.rejected,
        "shapes": dict(s.shapes),
        "output_controls": dict(s.output_controls),
        "patched_params": dict(s.patched_params),
        "patch_floats": dict(s.patch_floats),
        "rank_note": s.rank_note,
    }
    return {
        "model": info.model,
        "model_class": info.model_class,
        "lm_head": info.head,
        "summary": summary,
        "blocks": [_block(b) for b in info.blocks],
        "rejections": [{"path": r.path, "reason": r.reason} for r in info.rejections],
        **(
            {"notes": [{"path": r.path, "reason": r.reason} for r in info.notes]}
            if info.notes
            else {}
        ),
    }


def _block(b: BlockInspection) -> dict[str, Any]:
    return {
        "path": b.path,
        "shape": b.shape,
        "arrangement": b.arrangement,
        "norms": {"pre": b.norms.pre, "post": b.norms.post, "trailing": b.norms.trailing},
        "mlp": b.mlp,
        "gain": b.gain,
        "output_control": b.output_control,
        "parts": [_part(p) for p in b.parts],
        "tail": [_tail(t) for t in b.tail],
        "patches": {rule: [_patch(p) for p in entries] for rule, entries in b.patches},
    }


def _part(p: Part) -> dict[str, Any]:
    out: dict[str, Any] = {"part": p.part, "module": p.module, "op": p.op, "control": p.control}
    optional = {
        "param": p.param,
        "layout": p.layout,
        "weight_shape": list(p.weight_shape) if p.weight_shape is not None else None,
        "bias": p.bias,
        "experts": p.experts,
        "patched_by_default": p.patched_by_default,
    }
    out.update((k, v) for k, v in optional.items() if v is not None)
    if p.part == "mlp_in":  # always says whether a pre norm makes it
        out["norm"] = p.norm
    if p.note is not None:
        out["note"] = p.note
    return out


def _tail(t: TailEntry) -> dict[str, Any]:
    if t.op == "times":
        return {"op": t.op, "factor": t.factor}
    if t.op == "times gate":
        return {"op": t.op, "module": t.module, "gate_op": t.node_op}
    out: dict[str, Any] = {"op": t.op, "term": t.term, "module": t.module, "term_op": t.node_op}
    if t.mixes_tokens is not None:
        out["mixes_tokens"] = t.mixes_tokens
    return out


def _patch(p: PatchEntry) -> dict[str, Any]:
    head = {"param": p.param, "module": p.module, "move": p.move}
    if p.kind == "vector":
        return {**head, "kind": p.kind, "shape": list(p.shape), "floats": p.floats}
    out: dict[str, Any] = {**head, "rank": p.rank, "kind": p.kind}
    if p.kind == "expert matrices":
        out.update(
            experts=p.experts, per_token="each routed expert", active_per_token=p.active_per_token
        )
    out.update(floats=p.floats, shape=list(p.shape))
    return out
