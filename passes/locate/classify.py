"""Analysis: the controllability role of every node that belongs to a located block."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ctxc.core.vocabulary import DEFAULT_RULE
from ctxc.passes.locate.block_map import BlockMap, MlpBlock
from ctxc.passes.locate.plan import plan

__all__ = ["INPUT_CONTROLLABLE", "NEITHER", "OUTPUT_CONTROLLABLE", "Role", "classify"]

INPUT_CONTROLLABLE = "input-controllable"
OUTPUT_CONTROLLABLE = "output-controllable"
NEITHER = "neither"


@dataclass(frozen=True)
class Role:
    """What a node is in its block and how the patch can act on it.

    Attributes:
        block: module path of the block.
        part: ``residual_in``, ``mlp_in``, ``inner_linear``, ``router``, ``expert_input_bank``,
            ``activation``, ``inner_function_linear`` (a shared expert's output map: its input is
            matched by the inner moves), ``outer_linear``, ``expert_output_bank``, ``post_norm``,
            ``post_norm_scale``, ``post_norm_bias``, ``gain``, ``gate``, ``addend`` (another
            term of the sum: a parallel attention output, a shared expert), ``experts_sum``,
            ``attention_output`` (the attention projection behind a post norm that makes
            ``residual_in``: the ``lora`` rule moves it, MATH.md 10) or ``residual_add``.
        control: ``input-controllable``, ``output-controllable`` or ``neither``.
        param: the parameter a patch can change at this node, if any.
        used: True when the solver patches ``param`` here with its default ``stable`` rule
            (:func:`~ctxc.passes.locate.plan.plan`); False for a controllable alternative.
    """

    block: str
    part: str
    control: str
    param: str | None = None
    used: bool = False


def classify(blocks: BlockMap) -> Mapping[str, Role]:
    """Roles of the nodes of every block, keyed by fx node name (pure; read-only mapping).

    The inner linears (and an MoE's router and expert input banks) read the MLP input: moving
    their weights moves the inner activation (input-controllable, MATH.md 1). The outer linear,
    a post norm's trainable scale or bias, or an MoE's expert output banks add any wanted vector
    to the branch output (output-controllable). Which one the solver uses is the block's
    ``output_control``; the others are recorded as controllable alternatives (``used=False``).
    """
    roles: dict[str, Role] = {}
    for b in blocks.blocks:
        _block_roles(b, roles)
    return MappingProxyType(roles)


def _block_roles(b: MlpBlock, roles: dict[str, Role]) -> None:
    used = {m.param: m.part for m in plan(b, DEFAULT_RULE).moves}
    roles[b.residual_in] = Role(b.path, "residual_in", NEITHER)
    roles[b.mlp_in] = Role(b.path, "mlp_in", NEITHER)
    for site in b.inner:
        part = used[site.weight]  # the stable rule moves every inner linear
        roles[site.node] = Role(b.path, part, INPUT_CONTROLLABLE, site.weight, used=True)
    for site in b.others:
        roles[site.node] = Role(b.path, "inner_function_linear", NEITHER, site.weight)
    roles[b.activation] = Role(b.path, "activation", NEITHER)
    outer_part = "expert_output_bank" if b.outer.experts else "outer_linear"
    roles[b.outer.node] = Role(
        b.path, outer_part, OUTPUT_CONTROLLABLE, b.outer.weight, used=b.outer.weight in used
    )
    if b.norm is not None:
        if b.scale is not None and b.scale.normalized:
            roles[b.scale.normalized] = Role(b.path, "post_norm", NEITHER)
        if b.scale is not None:
            roles[b.scale.node] = Role(
                b.path, "post_norm_scale", OUTPUT_CONTROLLABLE, b.scale.param, b.scale.param in used
            )
        # A fused LayerNorm applies scale and bias in one node: it takes the part the solver
        # uses (inspect lists the other as an alternative).
        bias_node = b.norm.bias_node
        if b.norm.bias and bias_node and (bias_node not in roles or b.output_control == "bias"):
            roles[bias_node] = Role(
                b.path, "post_norm_bias", OUTPUT_CONTROLLABLE, b.norm.bias, b.norm.bias in used
            )
    if b.experts is not None:
        roles[b.experts.gate] = Role(b.path, "gate", NEITHER)
        roles[b.experts.combine] = Role(b.path, "experts_sum", NEITHER)
    for step in b.tail:
        if step.kind == "gain":
            roles.setdefault(step.node, Role(b.path, "gain", NEITHER))
        elif step.kind == "gate" and step.side is not None:
            roles.setdefault(step.side, Role(b.path, "gate", NEITHER))
        elif step.kind == "add" and step.side is not None and step.node != b.residual_add:
            roles.setdefault(step.side, Role(b.path, "addend", NEITHER))
    if b.attention is not None:  # the lora rule's second surface (MATH.md 10)
        att = b.attention.site
        roles[att.node] = Role(b.path, "attention_output", OUTPUT_CONTROLLABLE, att.weight)
    roles[b.residual_add] = Role(b.path, "residual_add", NEITHER)
