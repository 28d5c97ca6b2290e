"""``ctxc inspect``: the inspection model of a model, built from its block map.

Per block: its shape (arrangement, norms, MLP kind), its parts with their controllability roles,
the ops between the output-controlled part and the residual add, and what each update rule
patches (parameter names, kinds, ranks); per rejected candidate: why. Everything comes from the
fields the locator put on each block (module paths, op kinds, shapes); nothing here walks the
graph. The renderers (text, JSON, HTML) take it from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from ctxc.core.vocabulary import RULES
from ctxc.inspect.analysis import (
    BlockInspection,
    ModelInspection,
    Norms,
    Part,
    PatchEntry,
    RejectedBlock,
    TailEntry,
)
from ctxc.models.vlm import untouched_modules
from ctxc.passes.locate.block_map import BlockMap, LinearSite, MlpBlock, StepKind, TailStep, Term
from ctxc.passes.locate.classify import (
    INPUT_CONTROLLABLE,
    NEITHER,
    OUTPUT_CONTROLLABLE,
    Role,
    classify,
)
from ctxc.passes.locate.plan import plan
from ctxc.store.traced import traced_blocks

__all__ = ["ModelInspection", "describe", "inspect_model"]

_UNTOUCHED = (
    "not on the text path ({n:,} parameters): never patched; an image in the context acts on "
    "the query through attention in the language model"
)
_TRAILING_NOTE = (
    "the outer linear matches the sum it normalises (its scale and bias are "
    "output-controllable alternatives)"
)


def inspect_model(model: torch.nn.Module) -> ModelInspection:
    """Trace ``model`` (or reuse its trace) and describe every block it finds.

    Args:
        model: a causal LM.

    Returns:
        its :class:`ModelInspection`.
    """
    traced, blocks = traced_blocks(model)
    info = describe(model, blocks)
    # A vision tower and projector are not on the text path: say so (compiler/models/vlm.py).
    # Export lifts every parameter; those the text path reads are the placeholders with users.
    read = {p for name, p in traced.param_of.items() if traced.node(name).users}
    untouched = untouched_modules(model, read)
    notes = tuple(RejectedBlock(path, _UNTOUCHED.format(n=n)) for path, n in untouched)
    return replace(info, notes=info.notes + notes) if notes else info


def describe(model: torch.nn.Module, blocks: BlockMap) -> ModelInspection:
    """The :class:`ModelInspection` of a model's block map (pure).

    Args:
        model: the model (for its name and class).
        blocks: its block map.

    Returns:
        the inspection.
    """
    roles = classify(blocks)
    return ModelInspection(
        model=str(getattr(model, "ctxc_name", "")),
        model_class=type(model).__name__,
        head=blocks.head_module,
        blocks=tuple(_block(b, roles) for b in blocks.blocks),
        rejections=tuple(RejectedBlock(r.where, r.reason) for r in blocks.rejections),
        rules=RULES,
        notes=tuple(RejectedBlock(r.where, r.reason) for r in blocks.notes),
    )


def _block(b: MlpBlock, roles: Mapping[str, Role]) -> BlockInspection:
    tail = tuple(_tail_entry(s) for s in b.tail if s.kind != StepKind.VIEW)
    return BlockInspection(
        path=b.path,
        shape=_shape(b),
        arrangement="parallel" if b.parallel else "sequential",
        norms=Norms(b.pre_norm, b.norm.module if b.norm else None, b.trailing_norm),
        mlp=_mlp_kind(b),
        gain=b.gain,
        output_control=b.output_control,
        parts=_parts_of(b, roles),
        tail=tail,
        patches=tuple((rule, _patches(b, rule)) for rule in RULES),
    )


def _shape(b: MlpBlock) -> str:
    """The block's shape in words: arrangement, norms, MLP kind, linears, gain."""
    post = b.norm.module if b.norm is not None else None
    if b.trailing_norm:
        norms = "post-LN (norm after the residual add)"
    elif b.pre_norm and post:
        norms = "sandwich norms"
    elif post:
        norms = "post-sublayer norm"
    elif b.pre_norm:
        norms = "pre-norm"
    else:
        norms = "no norm"
    features = ["parallel" if b.parallel else "sequential", norms, _mlp_kind(b)]
    if any(s.bias for s in (*b.inner, b.outer)):
        features.append("biased linears")
    if b.outer.layout == "in_out" and not b.outer.experts:
        features.append(f"{b.outer.op} with [in, out] weights")
    elif b.outer.op != "aten.linear" and not b.outer.experts:
        features.append(f"{b.outer.op} linears")
    if b.gain != 1.0:
        features.append(f"branch scaled by {b.gain:g}")
    return ", ".join(features)


def _mlp_kind(b: MlpBlock) -> str:
    if b.experts is not None:
        kind = f"mixture of experts ({b.experts.num_experts} experts, top {b.experts.top_k})"
        for gated in b.gated_others:
            kind += " + shared expert" + (" with a sigmoid gate" if gated else "")
        return kind
    plain = [s for s in b.inner if not s.experts and s.node not in b.routers]
    if len(plain) >= 2:
        return "gated MLP"
    if b.fused_gate_up:
        return "gated MLP (fused gate/up)"
    return "plain MLP"


def _parts_of(b: MlpBlock, roles: Mapping[str, Role]) -> tuple[Part, ...]:
    """The block's parts, from the residual input to the add, with their roles."""
    parts = [_node_part(b, b.residual_in, "residual_in")]
    parts.append(_node_part(b, b.mlp_in, "mlp_in", norm=b.pre_norm))
    for site in b.inner:
        kind = roles[site.node].part if site.node in roles else "inner_linear"
        parts.append(_site_part(b, roles, site, kind, INPUT_CONTROLLABLE))
    parts += [_site_part(b, roles, s, "inner_function_linear", NEITHER) for s in b.others]
    parts.append(_node_part(b, b.activation, "activation"))
    outer_kind = "expert_output_bank" if b.outer.experts else "outer_linear"
    parts.append(_site_part(b, roles, b.outer, outer_kind, OUTPUT_CONTROLLABLE))
    if b.outer.bias is not None:
        bias = Part("outer_bias", b.outer.module, "bias", OUTPUT_CONTROLLABLE, b.outer.bias)
        parts.append(replace(bias, patched_by_default=False))  # an alternative, never used
    parts += _norm_parts(b)
    if b.experts is not None:
        parts.append(_node_part(b, b.experts.gate, "gate"))
        parts.append(_node_part(b, b.experts.combine, "experts_sum"))
    parts.append(_node_part(b, b.residual_add, "residual_add"))
    if b.trailing_norm:
        op = "norm of the residual sum"
        parts.append(Part("trailing_norm", b.trailing_norm, op, NEITHER, note=_TRAILING_NOTE))
    return tuple(parts)


def _node_part(b: MlpBlock, node: str, part: str, norm: str | None = None) -> Part:
    label = b.label(node)
    return Part(part, label.module, label.op, NEITHER, norm=norm)


def _site_part(
    b: MlpBlock, roles: Mapping[str, Role], site: LinearSite, part: str, control: str
) -> Part:
    shape = b.param_shape(site.weight)
    role = roles.get(site.node)
    return Part(
        part,
        site.module,
        site.op,
        control,
        param=site.weight,
        layout=site.layout,
        weight_shape=shape,
        bias=site.bias or None,
        experts=shape[0] if site.experts and shape else None,
        patched_by_default=role.used if role is not None and role.param == site.weight else None,
    )


def _norm_parts(b: MlpBlock) -> list[Part]:
    """The post norm, its scale and its bias (output-controllable alternatives)."""
    n = b.norm
    if n is None:
        return []
    op = n.fused or ("layer norm" if n.centered else "rms norm")
    parts = [Part("post_norm", n.module, op, NEITHER)]
    if n.scale is not None:
        times = f"times ({n.scale.alpha:g} w + {n.scale.offset:g})"
        used = b.output_control == "scale"
        parts.append(
            Part(
                "post_norm_scale",
                n.module,
                times,
                OUTPUT_CONTROLLABLE,
                param=n.scale.param,
                patched_by_default=used,
            )
        )
    if n.bias is not None:
        used = b.output_control == "bias"
        parts.append(
            Part(
                "post_norm_bias",
                n.module,
                "plus b",
                OUTPUT_CONTROLLABLE,
                param=n.bias,
                patched_by_default=used,
            )
        )
    return parts


def _tail_entry(step: TailStep) -> TailEntry:
    if step.kind == StepKind.GAIN:
        return TailEntry("times", factor=step.factor)
    origin = step.origin
    assert origin is not None  # the locator labels every add and gate step
    if step.kind == StepKind.GATE:
        return TailEntry("times gate", module=origin.module, node_op=origin.op)
    mixes = step.mixes_tokens if step.term == Term.OTHER else None
    return TailEntry(
        "plus", module=origin.module, node_op=origin.op, term=str(step.term), mixes_tokens=mixes
    )


def _patches(b: MlpBlock, rule: str) -> tuple[PatchEntry, ...]:
    """The parameters ``rule`` patches in ``b``: the solver's own plan (passes/locate/plan.py)."""
    top_k = b.experts.top_k if b.experts is not None else 1  # experts a token routes to
    out = []
    for m in plan(b, rule).moves:
        if m.site is not None:
            out.append(_matrix(b, m.site, m.move, top_k))
        else:
            out.append(_vector(b, m.param))
    return tuple(out)


def _matrix(b: MlpBlock, site: LinearSite, move: str, top_k: int) -> PatchEntry:
    shape = b.param_shape(site.weight)
    if site.experts:
        return PatchEntry(
            site.weight,
            site.module,
            move,
            "expert matrices",
            shape,
            floats=top_k * sum(shape[1:]),
            experts=shape[0] if shape else None,
            active_per_token=top_k,
        )
    return PatchEntry(site.weight, site.module, move, "matrix", shape, floats=sum(shape))


def _vector(b: MlpBlock, param: str) -> PatchEntry:
    shape = b.param_shape(param)
    module = param.rsplit(".", 1)[0]
    floats = shape[0] if shape else 0
    return PatchEntry(param, module, "output", "vector", shape, floats, rank=None)
