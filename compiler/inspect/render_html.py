"""Renderer: an inspection as an HTML page, one SVG diagram per distinct block shape.

The markup is the Jinja template ``templates/inspect.html`` (package data); this module lays
the diagram out (which boxes go in which column, where each box and arrow sits) and hands the
template plain values. Text is escaped with :func:`html.escape` (filter ``h``) rather than
Jinja's autoescape, whose entities for quotes differ (``&#34;`` for ``&quot;``): the page stays
byte for byte what earlier releases wrote.
"""

from __future__ import annotations

import functools
import html
import itertools
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

import jinja2

from ctxc.inspect.render_text import patch_kind_text

if TYPE_CHECKING:  # the model's methods call this module: no import cycle at run time
    from ctxc.inspect.analysis import BlockInspection, ModelInspection, Part, TailEntry

__all__ = ["render_html"]

INPUT, OUTPUT, NEITHER = "input-controllable", "output-controllable", "neither"
_FILL = {INPUT: "#dbeafe", OUTPUT: "#ffedd5", NEITHER: "#f3f4f6"}
_BOX_W, _BOX_H, _GAP_X, _GAP_Y, _TOP = 190, 46, 40, 18, 70
_LEGEND_STEP = 190
_ROLE = {
    "router": "router",
    "inner_linear": "inner linear",
    "expert_input_bank": "experts in",
    "inner_function_linear": "inside f",
    "outer_linear": "outer linear",
    "expert_output_bank": "experts out",
    "outer_bias": "outer bias",
    "post_norm": "post norm",
    "post_norm_scale": "scale",
    "post_norm_bias": "bias",
}


@dataclass(frozen=True)
class _Box:
    title: str
    detail: str
    control: str
    param: str | None = None


def render_html(info: ModelInspection) -> str:
    """The page.

    Args:
        info: the inspection.

    Returns:
        a standalone HTML document: summary, per shape (lettered in order of appearance) a
        diagram of its first block and the table of patched parameters, the rejections.
    """
    s = info.summary()
    shapes: dict[str, list[BlockInspection]] = {}
    for b in info.blocks:
        shapes.setdefault(b.shape, []).append(b)
    page = {
        "model_class": info.model_class,
        "model": info.model,
        "patchable": s.patchable,
        "rejected": s.rejected,
        "patched_params": s.patched_params,
        "rank_note": s.rank_note,
        "shapes": [_section(i, shape, blocks) for i, (shape, blocks) in enumerate(shapes.items())],
        "rejections": info.rejections,
    }
    return _template().render(page=page)


@functools.cache
def _template() -> jinja2.Template:
    template = resources.files("ctxc").joinpath("templates").joinpath("inspect.html")
    source = template.read_text("utf-8")
    env = jinja2.Environment(
        autoescape=False,  # every value goes through the `h` filter (see the module docstring)
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["h"] = html.escape
    return env.from_string(source)


def _section(i: int, shape: str, blocks: list[BlockInspection]) -> dict:
    first = blocks[0]
    rows = [
        (rule, p.param, p.move, patch_kind_text(p))
        for rule, entries in first.patches
        for p in entries
    ]
    return {
        "letter": chr(ord("A") + i),
        "name": shape,
        "paths": [b.path for b in blocks],
        "output_control": first.output_control,
        "diagram": _layout(first, _columns(first)),
        "rows": rows,
    }


def _columns(b: BlockInspection) -> list[list[_Box]]:
    """The diagram's boxes, column by column: data flow left to right."""
    path = b.path
    by: dict[str, list[Part]] = {}
    for p in b.parts:
        by.setdefault(p.part, []).append(p)

    def box(p: Part, title: str | None = None) -> _Box:
        role = _ROLE.get(p.part, p.part)
        return _Box(
            title or _short(p.module, path) or p.part, f"{role}: {p.op}", p.control, p.param
        )

    columns = [[_Box("v (residual in)", _short(by["residual_in"][0].module, path), NEITHER)]]
    if b.norms.pre:
        columns.append([_Box("pre-norm", _short(b.norms.pre, path), NEITHER)])
    kinds = ("router", "inner_linear", "expert_input_bank")
    columns.append([box(p) for kind in kinds for p in by.get(kind, [])])
    columns.append([box(by["activation"][0], "activation h")])
    outer_kind = "expert_output_bank" if "expert_output_bank" in by else "outer_linear"
    outs = [box(by[outer_kind][0])]
    outs += [box(p) for kind in ("inner_function_linear", "outer_bias") for p in by.get(kind, [])]
    columns.append(outs)
    if "post_norm" in by:
        kinds = ("post_norm", "post_norm_scale", "post_norm_bias")
        columns.append([box(p) for kind in kinds for p in by.get(kind, [])])
    if "experts_sum" in by:
        columns.append([_Box("sum of gated experts", "per token", NEITHER)])
    tail = [t for t in b.tail if not (t.op == "plus" and t.term == "residual")]
    if tail:
        columns.append([_tail_box(t, path) for t in tail])
    columns.append([_Box("+", "residual add", NEITHER)])
    if b.norms.trailing:
        columns.append([_Box("trailing norm", _short(b.norms.trailing, path), NEITHER)])
    return columns


def _layout(b: BlockInspection, columns: list[list[_Box]]) -> dict:
    """Where each box, arrow and legend entry sits; a box is marked when a rule patches it."""
    patched = {p.param for _, entries in b.patches for p in entries}
    rows = max(len(c) for c in columns)
    width = len(columns) * (_BOX_W + _GAP_X) + 20
    height = _TOP + rows * (_BOX_H + _GAP_Y) + 70
    boxes: list[dict[str, Any]] = []
    centres: list[list[tuple[float, float]]] = []
    for i, col in enumerate(columns):
        x = 10 + i * (_BOX_W + _GAP_X)
        centres.append([])
        for j, bx in enumerate(col):
            y = _TOP + j * (_BOX_H + _GAP_Y)
            centres[-1].append((x, y + _BOX_H / 2))
            boxes.append(
                {
                    "x": x,
                    "y": y,
                    "fill": _FILL[bx.control],
                    "hit": bool(bx.param) and bx.param in patched,
                    "title": bx.title[:30],
                    "detail": bx.detail[:31],
                }
            )
    arrows = [
        (x0 + _BOX_W, y0, x1 - 2, y1)
        for left, right in itertools.pairwise(centres)
        for x0, y0 in left
        for x1, y1 in right
    ]
    # The residual stream: from v along the top into the add.
    x_v, y_v = centres[0][0]
    add_col = next(i for i, c in enumerate(columns) if c and c[0].title == "+")
    x_a, y_a = centres[add_col][0]
    stream = (
        f"{x_v + _BOX_W / 2},{y_v - _BOX_H / 2} {x_v + _BOX_W / 2},30 "
        f"{x_a + _BOX_W / 2},30 {x_a + _BOX_W / 2},{y_a - _BOX_H / 2 - 2}"
    )
    legend = [(10 + k * _LEGEND_STEP, c, fill) for k, (c, fill) in enumerate(_FILL.items())]
    return {
        "width": width,
        "height": height,
        "box_w": _BOX_W,
        "box_h": _BOX_H,
        "boxes": boxes,
        "arrows": arrows,
        "stream": stream,
        "legend": legend,
        "legend_y": height - 22,
        "patched_x": 10 + len(_FILL) * _LEGEND_STEP,
    }


def _tail_box(t: TailEntry, path: str) -> _Box:
    if t.op == "times":
        return _Box(f"x {t.factor:g}", "constant gain", NEITHER)
    if t.op == "times gate":
        return _Box("x gate", _short(t.module or "", path), NEITHER)
    if t.mixes_tokens:
        return _Box("+ token mixer", f"parallel: {_short(t.module or '', path)}", NEITHER)
    return _Box(f"+ {t.term}", _short(t.module or "", path) or "parameter", NEITHER)


def _short(module: str, path: str) -> str:
    """``module`` relative to the block's path, or its last two components outside it."""
    if module and module.startswith(path + "."):
        return module[len(path) + 1 :]
    return ".".join(module.split(".")[-2:]) if module else ""
