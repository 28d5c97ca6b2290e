"""Analysis: the controllability role of every node that belongs to a located block."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ctxc.passes.block_map import BlockMap

__all__ = ["INPUT_CONTROLLABLE", "NEITHER", "OUTPUT_CONTROLLABLE", "Role", "classify"]

INPUT_CONTROLLABLE = "input-controllable"
OUTPUT_CONTROLLABLE = "output-controllable"
NEITHER = "neither"


@dataclass(frozen=True)
class Role:
    """What a node is in its block and how the patch can act on it.

    Attributes:
        block: module path of the block.
        part: ``residual_in``, ``mlp_in``, ``inner_linear``, ``activation``, ``outer_linear``,
            ``post_norm_scale``, ``post_norm`` or ``residual_add``.
        control: ``input-controllable``, ``output-controllable`` or ``neither``.
        param: the parameter the patch changes at this node, if any.
    """

    block: str
    part: str
    control: str
    param: str | None = None


def classify(blocks: BlockMap) -> Mapping[str, Role]:
    """Roles of the nodes of every block, keyed by fx node name (pure; read-only mapping).

    The inner linears read the MLP input: moving their weights moves the inner activation
    (input-controllable). The outer linear, or a post norm's trainable scale, adds any wanted
    vector to the branch output (output-controllable). Which one the solver uses is the block's
    ``output_control``; the other is recorded as ``neither``-patched but still controllable.
    """
    roles: dict[str, Role] = {}
    for b in blocks.blocks:
        roles[b.residual_in] = Role(b.path, "residual_in", NEITHER)
        roles[b.mlp_in] = Role(b.path, "mlp_in", NEITHER)
        for site in b.inner:
            roles[site.node] = Role(b.path, "inner_linear", INPUT_CONTROLLABLE, site.weight)
        roles[b.activation] = Role(b.path, "activation", NEITHER)
        roles[b.outer.node] = Role(b.path, "outer_linear", OUTPUT_CONTROLLABLE, b.outer.weight)
        if b.scale is not None:
            roles[b.scale.node] = Role(
                b.path, "post_norm_scale", OUTPUT_CONTROLLABLE, b.scale.param
            )
        roles[b.residual_add] = Role(b.path, "residual_add", NEITHER)
    return MappingProxyType(roles)
