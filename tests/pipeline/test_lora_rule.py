"""The ``lora`` rule (linear weights only) is exact on sandwich-norm blocks too (MATH.md 10).

Gemma 2, Gemma 3 and OLMo 2 put a fixed-RMS post norm behind both the attention and the MLP:
the rule moves ``o_proj`` and ``down_proj`` (and gate/up to the full run's MLP input), so the
two normalised outputs sum to the full run's block update. Llama and Qwen 3 have no post norm:
the down projection's output move alone is exact, and ``o_proj`` is left as it is.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ctxc
from ctxc.backends.peft.lora_adapter import emit_lora
from testbed.tiny_models import shared
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import random_ids

pytestmark = pytest.mark.tiny

SANDWICH = ("gemma2", "gemma3", "olmo2")
PLAIN = ("llama", "qwen3")


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("family", SANDWICH + PLAIN)
def test_lora_rule_is_exact_and_moves_linear_weights_only(family: str, k: int) -> None:
    model = shared(family)
    ctx, query = random_ids(11, 30), random_ids(12, k)
    result = ctxc.compile(model, context_ids=ctx, query_ids=query, update="lora")
    rep = result.report
    got, control = rep.emitted.max_abs_logit_diff, rep.control.max_abs_logit_diff
    msg = f"emitted max {got:.3g} mean {rep.emitted.mean_abs_logit_diff:.3g}, control {control:.3g}"
    assert got <= 1e-6 and rep.emitted.top1_match, msg
    assert control > 1e-2, "control too close: the test cannot fail; " + msg
    deltas = result.patch.deltas
    assert all(d.vector is None and d.u is not None for d in deltas.values()), sorted(deltas)
    o_proj = [p for p in deltas if p.endswith("self_attn.o_proj.weight")]
    blocks = len(rep.blocks)
    if family in SANDWICH:
        assert len(o_proj) == blocks and len(deltas) == 4 * blocks, sorted(deltas)
        assert all(b.reach_gap == 0.0 for b in rep.blocks), [b.reach_gap for b in rep.blocks]
    else:
        assert not o_proj and len(deltas) == 3 * blocks, sorted(deltas)
        assert all(b.reach_gap is None for b in rep.blocks)
    assert all(d.u.shape[1] == k for d in deltas.values()), "rank k per query position"


def test_lora_rule_is_the_same_patch_twice() -> None:
    model = shared("gemma3")
    ctx = random_ids(13, 24)
    one = ctxc.compile(model, context_ids=ctx, update="lora").patch.deltas
    two = ctxc.compile(model, context_ids=ctx, update="lora").patch.deltas
    assert sorted(one) == sorted(two)
    for name in one:
        assert torch.equal(one[name].dense(), two[name].dense()), name


@pytest.mark.parametrize("family", SANDWICH)
@needs_extra("peft")
def test_sandwich_adapters_follow_vllm_rules_and_hold_the_patch(family: str, tmp_path) -> None:
    model = shared(family)
    result = ctxc.compile(model, context_ids=random_ids(14, 28), update="lora")
    _, figures = emit_lora(model, result.patch, tmp_path, full=result.full_logits)
    assert figures.vllm.module_names == ("down_proj", "gate_proj", "o_proj", "up_proj")
    assert figures.vllm.r == 1 and figures.peft.modules_to_save == ()
    lora = figures.peft.lora
    assert lora.max_abs_logit_diff <= 1e-6 and lora.top1_match, lora


def test_the_summary_names_blocks_left_off_their_target() -> None:
    model = shared("gemma3")
    rep = ctxc.compile(model, context_ids=random_ids(15, 20), update="lora").report
    assert "lora:" not in rep.summary(), rep.summary()  # every block reached: nothing to say
    blocks = list(rep.blocks)
    blocks[1] = dataclasses.replace(blocks[1], reach_gap=0.5)
    blocks[2] = dataclasses.replace(blocks[2], reach_gap=None, unreached_norm=0.25)
    line = dataclasses.replace(rep, blocks=tuple(blocks)).summary().splitlines()[-1]
    assert line.startswith("lora: 1 block(s) out of reach of o_proj and down_proj"), line
    assert "largest gap 0.5 at model.layers.1.mlp" in line, line
    assert "1 block(s) behind a post norm with no second linear surface" in line, line
    assert "largest miss 0.25 at model.layers.2.mlp" in line, line
