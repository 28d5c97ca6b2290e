"""``ctxc inspect``: what the analyses find in a model, as text, stable JSON or an HTML page.

Per block: its shape (arrangement, norms, MLP kind), its parts with their controllability roles,
the ops between the output-controlled part and the residual add, and what each update rule
patches (parameter names, kinds, ranks); per rejected candidate: why. JSON uses module paths and
op kinds, never fx node names, so it is stable across exports. The HTML page draws each distinct
block shape once as an inline SVG diagram, with the patched parameters marked.
"""

from __future__ import annotations

import html
import json
from collections import Counter
from dataclasses import dataclass

import torch
from torch import fx

from ctxc.passes.block_map import BlockMap, LinearSite, MlpBlock
from ctxc.passes.classify import (
    INPUT_CONTROLLABLE,
    NEITHER,
    OUTPUT_CONTROLLABLE,
    Role,
    classify,
)
from ctxc.passes.graph_view import VIEW_LIKE, GraphView, op_name
from ctxc.passes.solve import UPDATE_RULES

__all__ = ["ModelInspection", "describe", "inspect_model"]

aten = torch.ops.aten

RANK_NOTE = (
    "ranks are for a single-token query; a k-token query gives rank-k matrix moves (a post-norm "
    "scale or bias matches one position only)"
)


@dataclass(frozen=True)
class ModelInspection:
    """Per-block findings of a model. JSON uses module paths and op kinds, never fx node names."""

    model: str
    model_class: str
    head: str | None
    blocks: tuple[dict, ...]
    rejections: tuple[dict, ...]

    def summary(self) -> dict:
        shapes = Counter(b["shape"] for b in self.blocks)
        controls = Counter(b["output_control"] for b in self.blocks)
        params = {r: sum(len(b["patches"][r]) for b in self.blocks) for r in UPDATE_RULES}
        floats = {
            r: sum(p["floats"] for b in self.blocks for p in b["patches"][r]) for r in UPDATE_RULES
        }
        return {
            "blocks": len(self.blocks) + len(self.rejections),
            "patchable": len(self.blocks),
            "rejected": len(self.rejections),
            "shapes": dict(sorted(shapes.items())),
            "output_controls": dict(sorted(controls.items())),
            "patched_params": params,
            "patch_floats": floats,
            "rank_note": RANK_NOTE,
        }

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "model_class": self.model_class,
            "lm_head": self.head,
            "summary": self.summary(),
            "blocks": list(self.blocks),
            "rejections": list(self.rejections),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def to_text(self) -> str:
        s = self.summary()
        lines = [
            f"{self.model_class} ({self.model or 'model'}): {s['patchable']} patchable "
            f"block(s), {s['rejected']} rejected; patched parameters: "
            + ", ".join(f"{r} {n}" for r, n in s["patched_params"].items())
        ]
        letters = {shape: chr(ord("A") + i) for i, shape in enumerate(s["shapes"])}
        for shape, n in s["shapes"].items():
            lines.append(f"  shape {letters[shape]}: {shape} ({n} block(s))")
        for b in self.blocks:
            lines.append(f"{b['path']} [shape {letters[b['shape']]}]")
            for p in b["parts"]:
                param = f" {p['param']}" if p.get("param") else ""
                lines.append(
                    f"    {p['part']:<22} {p['module'] or '-'} ({p['op']}){param}: {p['control']}"
                )
            tail = " -> ".join(_tail_text(t) for t in b["tail"]) or "-"
            lines.append(f"    tail to the residual add: {tail}")
            for rule, patches in b["patches"].items():
                desc = ", ".join(f"{p['param']} ({p['move']}, {_kind_text(p)})" for p in patches)
                lines.append(f"    {rule:<8} patches {desc}")
        for r in self.rejections:
            lines.append(f"{r['path']}: REJECTED: {r['reason']}")
        lines.append(f"({RANK_NOTE})")
        return "\n".join(lines)

    def to_html(self) -> str:
        return _html_page(self)


def inspect_model(model: torch.nn.Module) -> ModelInspection:
    """Trace ``model`` (or reuse its trace) and describe every block it finds."""
    from ctxc.pipeline import traced_blocks

    traced, blocks = traced_blocks(model)
    return describe(model, traced, blocks)


def describe(model, traced, blocks: BlockMap) -> ModelInspection:
    """The :class:`ModelInspection` of a traced model's block map (pure)."""
    view = GraphView(traced)
    roles = classify(blocks)
    head = view.module_path(view.by_name[blocks.head]) if blocks.head else None
    return ModelInspection(
        model=str(getattr(model, "ctxc_name", "")),
        model_class=type(model).__name__,
        head=head,
        blocks=tuple(_block_info(view, b, roles) for b in blocks.blocks),
        rejections=tuple({"path": r.where, "reason": r.reason} for r in blocks.rejections),
    )


# -- one block -------------------------------------------------------------------------------


def _block_info(view: GraphView, b: MlpBlock, roles) -> dict:
    return {
        "path": b.path,
        "shape": _shape(view, b),
        "arrangement": "parallel" if b.parallel else "sequential",
        "norms": {"pre": b.pre_norm, "post": b.post_norm, "trailing": b.trailing_norm},
        "mlp": _mlp_kind(view, b),
        "gain": b.gain,
        "output_control": b.output_control,
        "parts": _parts(view, b, roles),
        "tail": [_tail_step(view, b, s) for s in b.tail if s.kind != "view"],
        "patches": {rule: _patches(view, b, rule) for rule in UPDATE_RULES},
    }


def _shape(view: GraphView, b: MlpBlock) -> str:
    if b.trailing_norm:
        norms = "post-LN (norm after the residual add)"
    elif b.pre_norm and b.post_norm:
        norms = "sandwich norms"
    elif b.post_norm:
        norms = "post-sublayer norm"
    elif b.pre_norm:
        norms = "pre-norm"
    else:
        norms = "no norm"
    parts = ["parallel" if b.parallel else "sequential", norms, _mlp_kind(view, b)]
    if any(s.bias for s in (*b.inner, b.outer)):
        parts.append("biased linears")
    if b.outer.layout == "in_out" and not b.outer.experts:
        parts.append(f"{b.outer.op} with [in, out] weights")
    elif b.outer.op != "aten.linear" and not b.outer.experts:
        parts.append(f"{b.outer.op} linears")
    if b.gain != 1.0:
        parts.append(f"branch scaled by {b.gain:g}")
    return ", ".join(parts)


def _mlp_kind(view: GraphView, b: MlpBlock) -> str:
    if b.experts is not None:
        kind = f"mixture of experts ({b.experts.num_experts} experts, top {b.experts.top_k})"
        for other in b.others:
            gated = _gated(view, view.by_name[other.node])
            kind += " + shared expert" + (" with a sigmoid gate" if gated else "")
        return kind
    plain = [s for s in b.inner if not s.experts and s.node not in b.routers]
    if len(plain) >= 2:
        return "gated MLP"
    if len(plain) == 1 and _chunked(view, view.by_name[plain[0].node]):
        return "gated MLP (fused gate/up)"
    return "plain MLP"


def _chunked(view: GraphView, node: fx.Node) -> bool:
    """Does the linear's output get split in two (a fused gate/up projection)?"""
    for _ in range(4):
        users = view.tensor_users(node)
        if len(users) != 1:
            return False
        node = users[0]
        if node.target in (aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default):
            return True
        if node.target not in VIEW_LIKE and not view.keeps_rows(node):
            return False
    return False


def _gated(view: GraphView, node: fx.Node) -> bool:
    """Is this output multiplied by a per-row gate before it is summed?"""
    for _ in range(4):
        users = view.tensor_users(node)
        if len(users) != 1:
            return False
        node = users[0]
        if node.target == aten.mul.Tensor:
            return True
        if node.target not in VIEW_LIKE and not view.keeps_rows(node):
            return False
    return False


def _node_desc(view: GraphView, name: str) -> tuple[str, str]:
    node = view.by_name[name]
    if node.op == "placeholder":
        return "", "parameter"
    return view.module_path(node), op_name(node)


def _part(view, b, roles, name: str, part: str, control: str, param=None, **extra) -> dict:
    module, op = _node_desc(view, name)
    role: Role | None = roles.get(name)
    out = {"part": part, "module": module, "op": op, "control": control}
    if param:
        out["param"] = param
    if role is not None and role.param == param and param:
        out["patched_by_default"] = role.used
    out.update(extra)
    return out


def _parts(view: GraphView, b: MlpBlock, roles) -> list[dict]:
    carried = view.row_source(view.by_name[b.residual_in]).name  # through casts and reshapes
    parts = [
        _part(view, b, roles, carried, "residual_in", NEITHER),
        _part(view, b, roles, b.mlp_in, "mlp_in", NEITHER, norm=b.pre_norm),
    ]
    for site in b.inner:
        kind = roles[site.node].part if site.node in roles else "inner_linear"
        parts.append(_site_part(view, b, roles, site, kind, INPUT_CONTROLLABLE))
    for site in b.others:
        parts.append(_site_part(view, b, roles, site, "inner_function_linear", NEITHER))
    parts.append(_part(view, b, roles, b.activation, "activation", NEITHER))
    outer_kind = "expert_output_bank" if b.outer.experts else "outer_linear"
    parts.append(_site_part(view, b, roles, b.outer, outer_kind, OUTPUT_CONTROLLABLE))
    if b.outer.bias is not None:
        parts.append(
            {
                "part": "outer_bias",
                "module": b.outer.module,
                "op": "bias",
                "control": OUTPUT_CONTROLLABLE,
                "param": b.outer.bias,
                "patched_by_default": False,
            }
        )
    if b.norm is not None:
        n = b.norm
        parts.append(
            {
                "part": "post_norm",
                "module": n.module,
                "op": n.fused or ("layer norm" if n.centered else "rms norm"),
                "control": NEITHER,
            }
        )
        if n.scale is not None:
            parts.append(
                {
                    "part": "post_norm_scale",
                    "module": n.module,
                    "op": f"times ({n.scale.alpha:g} w + {n.scale.offset:g})",
                    "control": OUTPUT_CONTROLLABLE,
                    "param": n.scale.param,
                    "patched_by_default": b.output_control == "scale",
                }
            )
        if n.bias is not None:
            parts.append(
                {
                    "part": "post_norm_bias",
                    "module": n.module,
                    "op": "plus b",
                    "control": OUTPUT_CONTROLLABLE,
                    "param": n.bias,
                    "patched_by_default": b.output_control == "bias",
                }
            )
    if b.experts is not None:
        parts.append(_part(view, b, roles, b.experts.gate, "gate", NEITHER))
        parts.append(_part(view, b, roles, b.experts.combine, "experts_sum", NEITHER))
    parts.append(_part(view, b, roles, b.residual_add, "residual_add", NEITHER))
    if b.trailing_norm:
        parts.append(
            {
                "part": "trailing_norm",
                "module": b.trailing_norm,
                "op": "norm of the residual sum",
                "control": NEITHER,
                "note": "the outer linear matches the sum it normalises (its scale and bias are "
                "output-controllable alternatives)",
            }
        )
    return parts


def _site_part(view, b, roles, site: LinearSite, kind: str, control: str) -> dict:
    weight = _param_shape(view, site.weight)
    role = roles.get(site.node)
    out = {
        "part": kind,
        "module": site.module,
        "op": site.op,
        "control": control,
        "param": site.weight,
        "layout": site.layout,
        "weight_shape": weight,
    }
    if site.bias:
        out["bias"] = site.bias
    if site.experts:
        out["experts"] = weight[0] if weight else None
    if role is not None and role.param == site.weight:
        out["patched_by_default"] = role.used
    return out


def _param_shape(view: GraphView, param: str) -> list[int]:
    for placeholder, name in view.param_of.items():
        if name == param:
            return list(view.shape(view.by_name[placeholder]) or ())
    return []


def _tail_step(view: GraphView, b: MlpBlock, step) -> dict:
    if step.kind == "gain":
        return {"op": "times", "factor": step.factor}
    if step.kind == "gate":
        module, op = _node_desc(view, step.side)
        return {"op": "times gate", "module": module, "gate_op": op}
    side = step.side
    if step.node == b.residual_add:  # the tensor the residual carries, through casts
        side = view.row_source(view.by_name[side]).name
    module, op = _node_desc(view, side)
    if view.by_name[step.side].op == "placeholder":
        term = "bias"
    elif step.node == b.residual_add:
        term = "residual"
    else:
        term = "other term"
    out = {"op": "plus", "term": term, "module": module, "term_op": op}
    if term == "other term":
        side = view.by_name[step.side]
        anc = view.ancestors(side) & view.descendants(view.by_name[b.residual_in])
        out["mixes_tokens"] = any(view.is_token_mixing(n) for n in anc)
    return out


def _patches(view: GraphView, b: MlpBlock, rule: str) -> list[dict]:
    out = []
    top_k = b.experts.top_k if b.experts is not None else 1  # experts a token routes to
    if rule != "output":
        out += [_matrix(view, s, "input", top_k) for s in b.inner]
    ctl = b.output_control
    if ctl in ("linear", "experts"):
        out.append(_matrix(view, b.outer, "output", top_k))
    elif ctl == "scale":
        assert b.scale is not None
        if rule in ("stable", "output") and b.stable_ok:
            out.append(_matrix(view, b.outer, "output", top_k))
        out.append(_vector(view, b.scale.param))
    elif ctl == "bias":
        assert b.norm is not None and b.norm.bias is not None
        out.append(_vector(view, b.norm.bias))
    return out


def _matrix(view: GraphView, site: LinearSite, move: str, top_k: int) -> dict:
    shape = _param_shape(view, site.weight)
    entry = {"param": site.weight, "module": site.module, "move": move, "rank": 1}
    if site.experts:
        entry.update(
            kind="expert matrices",
            experts=shape[0] if shape else None,
            per_token="each routed expert",
            active_per_token=top_k,
            floats=top_k * sum(shape[1:]),
        )
    else:
        entry.update(kind="matrix", floats=sum(shape))
    entry["shape"] = shape
    return entry


def _vector(view: GraphView, param: str) -> dict:
    shape = _param_shape(view, param)
    return {
        "param": param,
        "module": param.rsplit(".", 1)[0],
        "move": "output",
        "kind": "vector",
        "shape": shape,
        "floats": shape[0] if shape else 0,
    }


def _kind_text(p: dict) -> str:
    if p["kind"] == "vector":
        return "vector"
    if p["kind"] == "expert matrices":
        return "rank 1 per routed expert"
    return f"rank {p['rank']}"


def _tail_text(t: dict) -> str:
    if t["op"] == "times":
        return f"x {t['factor']:g}"
    if t["op"] == "times gate":
        return f"x gate ({t['module']})"
    if t["term"] == "other term" and t.get("mixes_tokens"):
        return f"+ {t['module']} (token mixer: parallel)"
    return f"+ {t['term']} ({t['module'] or 'parameter'})"


# -- HTML ------------------------------------------------------------------------------------

_FILL = {INPUT_CONTROLLABLE: "#dbeafe", OUTPUT_CONTROLLABLE: "#ffedd5", NEITHER: "#f3f4f6"}
_BOX_W, _BOX_H, _GAP_X, _GAP_Y, _TOP = 190, 46, 40, 18, 70
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


def _short(module: str, path: str) -> str:
    """``module`` relative to the block's path, or its last two components outside it."""
    if module and module.startswith(path + "."):
        return module[len(path) + 1 :]
    return ".".join(module.split(".")[-2:]) if module else ""


def _diagram(b: dict) -> str:
    """An SVG of one block: data flow left to right, the residual stream along the top."""
    path = b["path"]
    by = {}
    for p in b["parts"]:
        by.setdefault(p["part"], []).append(p)
    patched = {p["param"] for rule in b["patches"].values() for p in rule}
    columns: list[list[tuple[str, str, str, str | None]]] = []  # (title, detail, control, param)

    def box(p: dict, title: str | None = None) -> tuple[str, str, str, str | None]:
        role = _ROLE.get(p["part"], p["part"])
        return (
            title or _short(p["module"], path) or p["part"],
            f"{role}: {p['op']}",
            p["control"],
            p.get("param"),
        )

    v_module = _short(by["residual_in"][0]["module"], path)
    columns.append([("v (residual in)", v_module, NEITHER, None)])
    if b["norms"]["pre"]:
        columns.append([("pre-norm", _short(b["norms"]["pre"], path), NEITHER, None)])
    inner = [
        box(p) for kind in ("router", "inner_linear", "expert_input_bank") for p in by.get(kind, [])
    ]
    columns.append(inner)
    act = [box(by["activation"][0], "activation h")]
    columns.append(act)
    outer_kind = "expert_output_bank" if "expert_output_bank" in by else "outer_linear"
    outs = [box(by[outer_kind][0])]
    outs += [box(p) for p in by.get("inner_function_linear", [])]
    outs += [box(p) for p in by.get("outer_bias", [])]
    columns.append(outs)
    if "post_norm" in by:
        col = [box(by["post_norm"][0])]
        col += [box(p) for p in by.get("post_norm_scale", [])]
        col += [box(p) for p in by.get("post_norm_bias", [])]
        columns.append(col)
    if "experts_sum" in by:
        columns.append([("sum of gated experts", "per token", NEITHER, None)])
    tail = [t for t in b["tail"] if not (t["op"] == "plus" and t["term"] == "residual")]
    if tail:
        columns.append([_tail_box(t, path) for t in tail])
    columns.append([("+", "residual add", NEITHER, None)])
    if b["norms"]["trailing"]:
        columns.append([("trailing norm", _short(b["norms"]["trailing"], path), NEITHER, None)])

    rows = max(len(c) for c in columns)
    width = len(columns) * (_BOX_W + _GAP_X) + 20
    height = _TOP + rows * (_BOX_H + _GAP_Y) + 70
    svg = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker>'
        "</defs>",
    ]
    centres: list[list[tuple[float, float]]] = []
    for i, col in enumerate(columns):
        x = 10 + i * (_BOX_W + _GAP_X)
        centres.append([])
        for j, (title, detail, control, param) in enumerate(col):
            y = _TOP + j * (_BOX_H + _GAP_Y)
            centres[-1].append((x, y + _BOX_H / 2))
            hit = param in patched if param else False
            stroke = 'stroke="#dc2626" stroke-width="3"' if hit else 'stroke="#555"'
            svg.append(
                f'<rect x="{x}" y="{y}" width="{_BOX_W}" height="{_BOX_H}" rx="6" '
                f'fill="{_FILL[control]}" {stroke}/>'
            )
            label = html.escape(title[:30])
            svg.append(f'<text x="{x + 8}" y="{y + 18}" font-weight="bold">{label}</text>')
            sub = html.escape((detail or "")[:31])
            svg.append(f'<text x="{x + 8}" y="{y + 36}" fill="#333">{sub}</text>')
            if hit:  # a red corner badge: this box's parameter is patched by some rule
                svg.append(
                    f'<circle cx="{x + _BOX_W}" cy="{y}" r="7" fill="#dc2626"/>'
                    f'<text x="{x + _BOX_W}" y="{y + 4}" text-anchor="middle" fill="white" '
                    'font-size="10" font-weight="bold">P</text>'
                )
    for i in range(len(centres) - 1):
        for x0, y0 in centres[i]:
            for x1, y1 in centres[i + 1]:
                svg.append(
                    f'<line x1="{x0 + _BOX_W}" y1="{y0}" x2="{x1 - 2}" y2="{y1}" stroke="#555" '
                    'marker-end="url(#arrow)"/>'
                )
    # The residual stream: from v along the top into the add.
    x_v, y_v = centres[0][0]
    add_col = next(i for i, c in enumerate(columns) if c and c[0][0] == "+")
    x_a, y_a = centres[add_col][0]
    svg.append(
        f'<polyline points="{x_v + _BOX_W / 2},{y_v - _BOX_H / 2} {x_v + _BOX_W / 2},30 '
        f'{x_a + _BOX_W / 2},30 {x_a + _BOX_W / 2},{y_a - _BOX_H / 2 - 2}" fill="none" '
        'stroke="#111" stroke-width="2" marker-end="url(#arrow)"/>'
    )
    svg.append('<text x="20" y="22" fill="#111">residual stream</text>')
    legend_y = height - 22
    for k, (control, fill) in enumerate(_FILL.items()):
        lx = 10 + k * 190
        svg.append(
            f'<rect x="{lx}" y="{legend_y - 12}" width="14" height="14" fill="{fill}" '
            'stroke="#555"/>'
        )
        svg.append(f'<text x="{lx + 20}" y="{legend_y}">{control}</text>')
    svg.append(
        f'<rect x="{10 + 3 * 190}" y="{legend_y - 12}" width="14" height="14" fill="white" '
        'stroke="#dc2626" stroke-width="3"/>'
    )
    note = "P: its parameter is patched (see the table)"
    svg.append(f'<text x="{30 + 3 * 190}" y="{legend_y}">{note}</text>')
    svg.append("</svg>")
    return "\n".join(svg)


def _tail_box(t: dict, path: str) -> tuple[str, str, str, str | None]:
    if t["op"] == "times":
        return (f"x {t['factor']:g}", "constant gain", NEITHER, None)
    if t["op"] == "times gate":
        return ("x gate", _short(t["module"], path), NEITHER, None)
    if t.get("mixes_tokens"):
        return ("+ token mixer", f"parallel: {_short(t['module'], path)}", NEITHER, None)
    return (f"+ {t['term']}", _short(t["module"], path) or "parameter", NEITHER, None)


def _html_page(info: ModelInspection) -> str:
    d = info.to_dict()
    s = d["summary"]
    esc = html.escape
    out = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>ctxc inspect: {esc(info.model_class)}</title>",
        "<style>body{font-family:sans-serif;margin:24px;color:#111}"
        "table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:4px 8px;"
        "text-align:left;font-size:13px}th{background:#f3f4f6}.rej{color:#b91c1c}"
        "code{font-size:12px}</style></head><body>",
        f"<h1>{esc(info.model_class)} <small>{esc(info.model)}</small></h1>",
        f"<p>{s['patchable']} patchable block(s), {s['rejected']} rejected. Patched parameters "
        + ", ".join(f"{esc(r)}: {n}" for r, n in s["patched_params"].items())
        + f". <em>{esc(RANK_NOTE)}</em></p>",
    ]
    shapes: dict[str, list[dict]] = {}
    for b in d["blocks"]:
        shapes.setdefault(b["shape"], []).append(b)
    for i, (shape, blocks) in enumerate(shapes.items()):
        first = blocks[0]
        out.append(f"<h2>Shape {chr(ord('A') + i)}: {esc(shape)}</h2>")
        out.append(
            f"<p>{len(blocks)} block(s): "
            + ", ".join(f"<code>{esc(b['path'])}</code>" for b in blocks)
            + f". Diagram of <code>{esc(first['path'])}</code>; output control: "
            f"<b>{esc(first['output_control'])}</b>.</p>"
        )
        out.append(_diagram(first))
        out.append("<table><tr><th>rule</th><th>parameter</th><th>move</th><th>kind</th></tr>")
        for rule, patches in first["patches"].items():
            for p in patches:
                out.append(
                    f"<tr><td>{esc(rule)}</td><td><code>{esc(p['param'])}</code></td>"
                    f"<td>{esc(p['move'])}</td><td>{esc(_kind_text(p))}</td></tr>"
                )
        out.append("</table>")
    if d["rejections"]:
        out.append("<h2>Rejected</h2><ul>")
        for r in d["rejections"]:
            out.append(f"<li class='rej'><code>{esc(r['path'])}</code>: {esc(r['reason'])}</li>")
        out.append("</ul>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
