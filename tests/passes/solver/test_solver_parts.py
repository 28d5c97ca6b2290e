"""The solver's parts: the plan (what a rule moves), the stepping reduced run, typed figures."""

from __future__ import annotations

import json

import pytest
import torch

import ctxc
from ctxc.core.delta_math import add_in_float32, lowrank_dense
from ctxc.passes.locate.classify import classify
from ctxc.passes.locate.graph_view import GraphView
from ctxc.passes.locate.plan import RULES, plan
from ctxc.passes.runtime.delta_actions import row_experts
from ctxc.passes.runtime.reduced_run import ReducedRun
from ctxc.passes.runtime.run_graph import run_logits
from ctxc.passes.solver import block_moves as moves
from ctxc.store.traced import traced_blocks
from testbed.tiny_models import VOCAB, shared

IDS = torch.randint(4, VOCAB, (16,), generator=torch.Generator().manual_seed(7)).tolist()


def _names(params: tuple[str, ...]) -> list[str]:
    return [p.split(".mlp.")[-1].split("layers.0.")[-1] for p in params]


@pytest.mark.tiny
def test_plan_per_rule_on_a_scaled_post_norm() -> None:
    _, blocks = traced_blocks(shared("gemma3"))
    b = blocks.blocks[0]
    got = {rule: _names(plan(b, rule).params) for rule in RULES}
    scale = "post_feedforward_layernorm.weight"
    assert got == {
        "standard": ["gate_proj.weight", "up_proj.weight", scale],
        "stable": ["gate_proj.weight", "up_proj.weight", "down_proj.weight", scale],
        "output": ["down_proj.weight", scale],
        # linear weights only: the attention output projection is the second linear surface
        "lora": [
            "self_attn.o_proj.weight",
            "gate_proj.weight",
            "up_proj.weight",
            "down_proj.weight",
        ],
    }, got
    assert plan(b, "stable").stable and not plan(b, "standard").stable
    assert {m.kind for m in plan(b, "stable").moves} == {"matrix", "vector"}


@pytest.mark.tiny
@pytest.mark.parametrize("name", ["llama", "gemma3", "mixtral", "stablelm"])
def test_classify_marks_what_the_default_plan_moves(name: str) -> None:
    _, blocks = traced_blocks(shared(name))
    roles = classify(blocks)
    for b in blocks.blocks:
        moved = set(plan(b, "stable").params)
        used = {r.param for r in roles.values() if r.block == b.path and r.used}
        assert used == moved, (b.path, used ^ moved)


@pytest.mark.tiny
def test_reduced_run_without_changes_is_the_plain_run() -> None:
    traced, blocks = traced_blocks(shared("gemma3"))
    query = torch.tensor([IDS[-2:]])
    view = GraphView.of(traced)
    run = ReducedRun(view, (), traced.placeholder_values(query))
    for b in blocks.blocks:  # stop at every block boundary, change nothing
        run.advance_to(view.by_name[b.mlp_in])
        run.advance_to(view.by_name[b.residual_add])
    out = run.finish()
    logits = (out[0] if isinstance(out, tuple | list) else out)[0].float()
    assert torch.equal(logits, run_logits(traced, query))
    with pytest.raises(RuntimeError, match="computed before"):
        run.advance_to(view.by_name[blocks.blocks[0].mlp_in])


def test_one_delta_arithmetic_matches_delta_materialize() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g).to(torch.bfloat16)
    u, v = torch.randn(6, 2, generator=g), torch.randn(5, 2, generator=g)
    delta = ctxc.Delta("w", "b", u=u, v=v)
    assert torch.equal(add_in_float32(w, lowrank_dense(u, v, "out_in")), delta.materialize(w))
    wt = w.T.contiguous()
    conv = ctxc.Delta("w", "b", u=u, v=v, layout="in_out")
    assert torch.equal(add_in_float32(wt, lowrank_dense(u, v, "in_out")), conv.materialize(wt))


@pytest.mark.tiny
def test_figures_that_do_not_apply_are_none_and_null() -> None:
    rep = ctxc.compile(shared("llama"), context_ids=IDS).report
    for b in rep.blocks:
        assert b.max_scale_change is None and b.min_divisor is None and b.min_gate_sum is None
    blocks = json.loads(rep.to_json())["blocks"]
    assert all(b["max_gain"] is None for b in blocks)
    rep = ctxc.compile(shared("gemma3"), context_ids=IDS).report
    assert all(isinstance(b.max_scale_change, float) for b in rep.blocks)


def test_rows_in_any_order_give_the_moves_of_consecutive_rows() -> None:
    # JetMoE sorts rows by expert and names each row's token (index_add); the moves must be
    # those of the same rows kept top_k per token (Mixtral's view + sum).
    gen = torch.Generator().manual_seed(0)
    k, top_k, d_ff, d = 3, 2, 6, 5
    ids = torch.tensor([0, 2, 1, 2, 0, 1])  # [k * top_k]
    gates = torch.rand(k * top_k, generator=gen)
    h, want = torch.randn(k * top_k, d_ff, generator=gen), torch.randn(k, d, generator=gen)
    order = ids.sort(stable=True)[1]  # rows sorted by expert
    s0, base = moves.experts_output_move(want, ids, gates, h, top_k)
    s1, got = moves.experts_output_move(
        want, ids[order], gates[order], h[order], 0, tokens=order // top_k
    )
    assert s0 == pytest.approx(s1, abs=1e-6)
    for (e0, u0, v0), (e1, u1, v1) in zip(base, got, strict=True):
        diff = (u0 @ v0.T - u1 @ v1.T).abs()
        assert e0 == e1 and float(diff.max()) <= 1e-5, (
            f"expert {e0}: max {float(diff.max()):.3g} mean {float(diff.mean()):.3g}"
        )
    chunks = [torch.zeros(3, 1), torch.zeros(0, 1), torch.zeros(2, 1)]
    assert row_experts(chunks).tolist() == [0, 0, 0, 2, 2]
