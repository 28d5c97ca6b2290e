"""The attention output projection as a fit surface (issue 25): exact at one position, a
lower fit error over many, the refit pass and distillation taking it, refused where no block
has it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ctxc
from ctxc.bake.data import FitData, special_prefix
from ctxc.bake.driver import BakeOptions, bake
from ctxc.bake.evaluate import evaluate
from ctxc.core.errors import CtxcError
from testbed.tiny_models import shared, tiny_tokenizer
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import assert_gives_full, diff_msg, random_ids

pytestmark = pytest.mark.tiny

EXACT = BakeOptions(ridge=0.0, scale_ridge=0.0, rank=None, attention=True)


def _attention_params(model) -> set[str]:
    layers = model.config.num_hidden_layers
    return {
        f"model.layers.{i}.{name}"
        for i in range(layers)
        for name in ("self_attn.o_proj.weight", "post_attention_layernorm.weight")
    }


@pytest.mark.parametrize("passes", [0, 1])
def test_one_position_with_attention_moves_is_exact(passes: int) -> None:
    """One fit position, ridge 0, no budget: the attention moves put ``v`` at ``v_C``, the MLP
    moves do the rest; the patch gives the full context's logits (a refit pass keeps them)."""
    model = shared("gemma3")
    ids = random_ids(7, 20)
    exact = ctxc.compile(model, context_ids=ids[:-1], query_ids=ids[-1:])
    data = FitData(ids[:-1], [], [ids[-1:]], ["file"])
    opts = dataclasses.replace(EXACT, refit_passes=passes)
    baked = bake(model, data=data, options=opts)
    moved = set(baked.patch.deltas) - set(exact.patch.deltas)
    assert moved == _attention_params(model), sorted(moved)
    assert_gives_full(model, baked.patch, ids[-1:], exact, "baked with attention vs full")
    for block in baked.report["blocks"]:
        o_proj = block["path"].replace("mlp", "self_attn.o_proj.weight")
        assert block["move_residuals"][o_proj] <= 1e-5, block["move_residuals"]


def test_attention_moves_lower_the_fit_error() -> None:
    """Many positions, the same ridge and rank: with the attention surface the fit data's KL
    is lower, every o_proj move keeps the rank budget, and twice gives the same patch."""
    model, tok = shared("gemma3"), tiny_tokenizer()
    queries = [random_ids(80 + i, 6) for i in range(4)]
    data = FitData([1, *random_ids(8, 24)], special_prefix(tok), queries, ["file"] * 4)
    kl, patches = [], []
    for attention in (False, True, True):
        opts = BakeOptions(ridge=1e-2, scale_ridge=1e-2, rank=4, attention=attention)
        patches.append(bake(model, data=data, options=opts).patch)
        kl.append(evaluate(model, patches[-1], data, gen_tokens=0).kl)
    control = evaluate(model, None, data, gen_tokens=0).kl
    msg = f"fit-data KL: control {control:.4g}, MLP only {kl[0]:.4g}, with attention {kl[1]:.4g}"
    assert kl[0] < 0.5 * control, msg
    assert kl[1] < 0.8 * kl[0], msg
    o_proj = {n: d.rank for n, d in patches[1].deltas.items() if "o_proj" in n}
    assert len(o_proj) == model.config.num_hidden_layers and set(o_proj.values()) == {4}, o_proj
    for name, d in patches[1].deltas.items():
        got, want = patches[2].deltas[name].dense(), d.dense()
        assert torch.equal(got, want), diff_msg(name, got, want)


@needs_extra("peft")
def test_distill_with_attention_trains_o_proj_too() -> None:
    model, tok = shared("gemma3"), tiny_tokenizer()
    data = FitData([1, *random_ids(9, 16)], special_prefix(tok),
                   [random_ids(90 + i, 5) for i in range(3)], ["file"] * 3)  # fmt: skip
    opts = BakeOptions(method="distill", rank=2, distill_steps=3, attention=True)
    baked = bake(model, data=data, options=opts)
    o_proj = [n for n in baked.patch.deltas if "o_proj" in n]
    assert len(o_proj) == model.config.num_hidden_layers, sorted(baked.patch.deltas)
    assert {baked.patch.deltas[n].rank for n in o_proj} == {2}


def test_a_model_without_the_surface_refuses_attention_moves() -> None:
    model, tok = shared("llama"), tiny_tokenizer()
    data = FitData([1, *random_ids(10, 12)], special_prefix(tok), [random_ids(11, 4)], ["file"])
    with pytest.raises(CtxcError, match="no block of this model has an attention output"):
        bake(model, data=data, options=BakeOptions(attention=True))
