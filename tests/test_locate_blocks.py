"""The locator and classifier on the families of the core compiler."""

from __future__ import annotations

import pytest
from tiny_models import FAMILIES, build

from ctxc.passes.classify import INPUT_CONTROLLABLE, OUTPUT_CONTROLLABLE, classify
from ctxc.passes.locate_blocks import locate_blocks
from ctxc.trace import trace


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_layer_has_one_gated_block(family: str) -> None:
    model = build(family)
    blocks = locate_blocks(trace(model))
    n = model.config.num_hidden_layers
    assert len(blocks.blocks) == n, [b.path for b in blocks.blocks]
    assert not blocks.rejections, blocks.rejections
    assert blocks.head is not None
    for i, b in enumerate(blocks.blocks):
        assert b.path == f"model.layers.{i}.mlp"
        assert {s.weight.rsplit(".", 2)[-2] for s in b.inner} == {"gate_proj", "up_proj"}
        assert b.outer.weight == f"model.layers.{i}.mlp.down_proj.weight"
        if family == "gemma3":
            assert b.output_control == "scale" and b.scale is not None
            assert b.scale.param == f"model.layers.{i}.post_feedforward_layernorm.weight"
            assert (b.scale.alpha, b.scale.offset) == (1.0, 1.0)  # Gemma scales by (1 + w)
        else:
            assert b.output_control == "linear" and b.scale is None


def test_classify_roles() -> None:
    blocks = locate_blocks(trace(build("gemma3")))
    roles = classify(blocks)
    controls = [r.control for r in roles.values()]
    n = len(blocks.blocks)
    assert controls.count(INPUT_CONTROLLABLE) == 2 * n
    assert controls.count(OUTPUT_CONTROLLABLE) == 2 * n  # down_proj and the post-norm scale
    assert locate_blocks(trace(build("gemma3"))) == blocks  # pure and deterministic
