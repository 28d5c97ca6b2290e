"""Thought patches (issue 13) on tiny random models: exactness at one position, the fit over
many, the report, and the backends taking a baked patch."""

from __future__ import annotations

import pytest
import torch

import ctxc
from ctxc.bake.data import FitData, special_prefix
from ctxc.bake.driver import BakeOptions, bake
from ctxc.bake.evaluate import evaluate
from ctxc.core.errors import CtxcError
from ctxc.passes.solver.fit_moves import FitOptions, fit_linear
from testbed.tiny_models import shared, tiny_tokenizer
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import assert_gives_full, diff_msg, random_ids

pytestmark = pytest.mark.tiny

EXACT = BakeOptions(ridge=0.0, scale_ridge=0.0, rank=None, attention=False)


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_one_position_gives_the_exact_patch(family: str) -> None:
    """One fit position, ridge 0, no rank budget: the deltas and figures of ctxc.compile."""
    model = shared(family)
    ids = random_ids(1, 20)
    exact = ctxc.compile(model, context_ids=ids[:-1], query_ids=ids[-1:])
    data = FitData(ids[:-1], [], [ids[-1:]], ["file"])
    baked = bake(model, data=data, options=EXACT)
    assert list(baked.patch.deltas) == list(exact.patch.deltas)
    for name, d in exact.patch.deltas.items():
        got, want = baked.patch.deltas[name].dense(), d.dense()
        scale = float(want.abs().max())
        assert float((got - want).abs().max()) <= 1e-4 * scale, diff_msg(name, got, want)
    assert_gives_full(model, baked.patch, ids[-1:], exact, "baked vs full")
    assert exact.report.emitted.max_abs_logit_diff <= 1e-5


def test_fit_over_many_positions_beats_the_control() -> None:
    """Many positions at once: the fitted patch moves the fit data toward the full context."""
    model, tok = shared("llama"), tiny_tokenizer()
    ctx = random_ids(2, 24)
    queries = [random_ids(10 + i, 6) for i in range(4)]
    data = FitData([1, *ctx], special_prefix(tok), queries, ["file"] * 4)
    # Small ridges and every position a constraint: this checks the fit, not the defaults'
    # held-out trade-offs (the BOS position is evaluated, so it is fitted here too).
    opts = BakeOptions(ridge=1e-3, scale_ridge=1e-3, rank=None, fit_prefix=True)
    baked = bake(model, data=data, options=opts)
    patched = evaluate(model, baked.patch, data, gen_tokens=4)
    control = evaluate(model, None, data, gen_tokens=4)
    msg = f"KL patched {patched.kl:.3g} vs control {control.kl:.3g}"
    assert control.kl > 1e-3, msg
    assert patched.kl < 0.1 * control.kl, msg
    assert data.positions == 4 * 7
    rep = baked.report
    assert rep["fit_positions"] == 28 and len(rep["blocks"]) == model.config.num_hidden_layers
    assert all(0 < b["effective_rank"] <= 28 for b in rep["blocks"])


def test_rank_budget_is_kept_and_checked() -> None:
    model, tok = shared("gemma3"), tiny_tokenizer()
    ctx = random_ids(3, 16)
    data = FitData(
        [1, *ctx], special_prefix(tok), [random_ids(20 + i, 5) for i in range(3)], ["file"] * 3
    )
    baked = bake(model, data=data, options=BakeOptions(rank=2))
    assert {d.rank for d in baked.patch.deltas.values() if d.u is not None} == {2}
    for bad, what in ((0, "at least 1"), (10_000, "past the matrix size")):
        with pytest.raises(CtxcError, match=what):
            bake(model, data=data, options=BakeOptions(rank=bad))


def test_reduced_rank_fit_is_the_best_rank_r_fit() -> None:
    """Reduced-rank regression: its residual is no worse than truncating the full fit's SVD."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(50, 12, generator=g), torch.randn(50, 9, generator=g)
    rrr = fit_linear(x, y, FitOptions(rank=3), "x")
    full = fit_linear(x, y, FitOptions(), "x")
    dw = full.u @ full.v.T  # [out, in]
    u, s, vh = torch.linalg.svd(dw)
    trunc = (u[:, :3] * s[:3]) @ vh[:3]
    res_trunc = float((x @ trunc.T - y).norm() / y.norm())
    assert rrr.u.shape[1] == 3
    assert rrr.rel_residual <= res_trunc + 1e-6, (rrr.rel_residual, res_trunc)
    assert full.rel_residual < rrr.rel_residual


@needs_extra("peft")
def test_baked_patch_goes_through_the_backends(tmp_path) -> None:
    from ctxc.backends.peft.adapter import emit_peft

    model, tok = shared("llama"), tiny_tokenizer()
    data = FitData([1, *random_ids(4, 12)], special_prefix(tok), [random_ids(30, 5)], ["file"])
    baked = bake(model, data=data, options=BakeOptions(rank=2))
    path = baked.patch.save(tmp_path / "patch.safetensors")
    again = ctxc.Patch.load(path, model)
    assert again.meta.update == "bake-fit"
    _, figures = emit_peft(model, again, tmp_path)
    assert (tmp_path / "adapter").is_dir() and figures is not None


@needs_extra("peft")
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_distill_trains_a_lora_of_the_rank_into_a_patch(precision: str) -> None:
    """Context distillation: a seeded LoRA becomes a patch; it lowers the fit data's KL and
    leaves the model as it was (with the output head in bfloat16 too: its forward restored)."""
    model, tok = shared("llama"), tiny_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = FitData([1, *random_ids(5, 16)], special_prefix(tok),
                   [random_ids(40 + i, 5) for i in range(3)], ["file"] * 3)  # fmt: skip
    opts = BakeOptions(
        method="distill", rank=4, distill_steps=30, distill_lr=1e-2, distill_precision=precision
    )
    baked = bake(model, data=data, options=opts)
    assert "forward" not in vars(model.get_output_embeddings())
    ranks = {d.rank for d in baked.patch.deltas.values()}
    assert ranks == {4}, ranks
    patched = evaluate(model, baked.patch, data, gen_tokens=0)
    control = evaluate(model, None, data, gen_tokens=0)
    assert patched.kl < 0.5 * control.kl, f"KL {patched.kl:.3g} vs control {control.kl:.3g}"
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed and not any("lora" in k for k in model.state_dict()), changed[:3]


def test_distill_off_topic_rows_taught_by_the_model_alone() -> None:
    """``off_topic_targets="none"``: an off-topic row's teacher is the unpatched model fed the
    row alone (the student's own input), the other rows' the model reading the context."""
    from ctxc.bake.distill import own_teacher, teacher_top
    from ctxc.core.vocabulary import OFF_TOPIC_KINDS, OFF_TOPIC_TEXT_KIND

    model, tok = shared("llama"), tiny_tokenizer()
    kinds = ["file", OFF_TOPIC_TEXT_KIND, "file"]
    data = FitData([1, *random_ids(5, 16)], special_prefix(tok),
                   [random_ids(40 + i, 5) for i in range(3)], kinds)  # fmt: skip
    full = teacher_top(model, data)
    got = own_teacher(model, data, full, OFF_TOPIC_KINDS)
    assert got[0] is full[0] and got[2] is full[2]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([data.reduced(1)])).logits[0]  # [n, vocab]
    want = logits[-got[1][0].shape[0] :].log_softmax(-1).topk(got[1][0].shape[-1], dim=-1)
    assert got[1][0].shape == full[1][0].shape, (got[1][0].shape, full[1][0].shape)
    err = (got[1][0] - want.values).abs()
    assert float(err.max()) <= 1e-4, f"max {float(err.max()):.3g} mean {float(err.mean()):.3g}"
    assert not torch.allclose(got[1][0], full[1][0]), "the context changed nothing here"
    opts = BakeOptions(method="distill", rank=2, distill_steps=2, off_topic_targets="none")
    again = [bake(model, data=data, options=opts).patch for _ in range(2)]
    for name, d in again[0].deltas.items():
        assert torch.equal(d.dense(), again[1].deltas[name].dense()), name
    weighed = BakeOptions(**{**vars(opts), "off_topic_weight": 4.0})
    heavier = bake(model, data=data, options=weighed).patch
    moved = max(
        float((heavier.deltas[n].dense() - d.dense()).abs().max())
        for n, d in again[0].deltas.items()
    )
    assert moved > 0.0, "an off-topic row's weight changed no delta"


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_refit_pass_of_an_exact_fit_stays_exact(family: str) -> None:
    """One position fitted exactly: the second pass finds no error to fit; the patch still
    gives the full context's logits (a post-norm block may move to another exact magnitude)."""
    model = shared(family)
    ids = random_ids(4, 20)
    exact = ctxc.compile(model, context_ids=ids[:-1], query_ids=ids[-1:])
    data = FitData(ids[:-1], [], [ids[-1:]], ["file"])
    twice = bake(model, data=data, options=BakeOptions(**{**vars(EXACT), "refit_passes": 1}))
    assert list(twice.patch.deltas) == list(exact.patch.deltas)
    assert_gives_full(model, twice.patch, ids[-1:], exact, "refit vs full")


def test_a_refit_pass_lowers_the_fit_error_and_keeps_the_rank() -> None:
    """Many positions under a ridge: the second pass fits what the first left (the fit data's
    KL drops); under a rank budget every summed move is cut back to it."""
    model, tok = shared("llama"), tiny_tokenizer()
    ctx = random_ids(5, 24)
    queries = [random_ids(30 + i, 6) for i in range(4)]
    data = FitData([1, *ctx], special_prefix(tok), queries, ["file"] * 4)
    kl = []
    for passes in (0, 1):
        opts = BakeOptions(ridge=1.0, rank=None, fit_prefix=True, refit_passes=passes)
        kl.append(evaluate(model, bake(model, data=data, options=opts).patch, data, 0).kl)
    assert kl[1] < 0.9 * kl[0], f"fit-data KL: one pass {kl[0]:.4g}, two passes {kl[1]:.4g}"
    budget = bake(model, data=data, options=BakeOptions(rank=2, refit_passes=1))
    assert {d.rank for d in budget.patch.deltas.values() if d.u is not None} == {2}
    assert budget.report["options"]["refit_passes"] == 1


def test_summed_delta_is_the_best_rank_r_sum() -> None:
    from ctxc.passes.solver.fit_solve import summed_delta
    from ctxc.patch import Delta

    g = torch.Generator().manual_seed(0)
    a = Delta("w", "b", u=torch.randn(7, 2, generator=g), v=torch.randn(5, 2, generator=g))
    b = Delta("w", "b", u=torch.randn(7, 2, generator=g), v=torch.randn(5, 2, generator=g))
    want = a.dense() + b.dense()  # [7, 5], rank 4
    summed = summed_delta(a, b, None)
    assert summed.rank == 4
    assert torch.allclose(summed.dense(), want, atol=1e-5), diff_msg("sum", summed.dense(), want)
    cut = summed_delta(a, b, 2)
    u, s, vh = torch.linalg.svd(want)
    best = (u[:, :2] * s[:2]) @ vh[:2]
    assert cut.rank == 2
    assert torch.allclose(cut.dense(), best, atol=1e-4), diff_msg("rank 2", cut.dense(), best)
    vec = summed_delta(
        Delta("s", "b", vector=torch.ones(3)), Delta("s", "b", vector=torch.ones(3)), 1
    )
    assert vec.vector is not None and vec.vector.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_rank_auto_gives_each_block_its_effective_rank(family: str) -> None:
    """Each MLP matrix at its block's effective rank; Gemma's attention output projection at
    its own (measured the same way on its own moves), within its size."""
    import math

    model, tok = shared(family), tiny_tokenizer()
    queries = [random_ids(40 + i, 6) for i in range(4)]
    data = FitData([1, *random_ids(6, 24)], special_prefix(tok), queries, ["file"] * 4)
    baked = bake(model, data=data, options=BakeOptions(rank_per_block=True))
    n = sum(len(q) for q in queries)  # the fitted rows (the prefix is run, not fitted)
    for block in baked.report["blocks"]:
        own = math.ceil(block["effective_rank"])
        got = {
            name: (d.rank, min(n, *model.get_parameter(name).shape))
            for name, d in baked.patch.deltas.items()
            if d.block == block["path"] and d.u is not None
        }
        mlp = {k: v for k, v in got.items() if "o_proj" not in k}
        assert mlp and all(r == min(own, size) for r, size in mlp.values()), (own, got)
        attention = [v for k, v in got.items() if "o_proj" in k]
        assert len(attention) == (family == "gemma3"), got
        assert all(1 <= r <= size for r, size in attention), got
        assert block["ranks"] == {name: r for name, (r, _) in got.items()}, block["ranks"]
    with pytest.raises(CtxcError, match="a LoRA has one rank"):
        BakeOptions(rank_per_block=True, method="distill")


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_an_off_topic_weight_of_two_is_the_row_fitted_twice(family: str) -> None:
    """``off_topic_weight`` (issue 53): each off-topic position counts ``w`` times in every
    least-squares fit of the bake (linear, scale, attention moves; ridge and rank as they are),
    so weight 2 gives the deltas of a bake whose off-topic row stands in the data twice; weight
    1 changes nothing."""
    from ctxc.bake.driver import row_weights

    model, tok = shared(family), tiny_tokenizer()
    ctx = [1, *random_ids(3, 20)]
    mine, other = random_ids(4, 6), random_ids(5, 7)
    prefix = special_prefix(tok)
    opts = BakeOptions(rank=4, attention=None)
    weighted = FitData(ctx, prefix, [mine, other], ["file", "off-topic-text"])
    twice = FitData(ctx, prefix, [mine, other, other], ["file", "file", "file"])
    weights = row_weights(weighted, 2.0)
    assert weights is not None and weights.tolist() == [1.0] * (len(prefix) + 6) + [2.0] * (
        len(prefix) + 7
    ), weights
    assert row_weights(weighted, 1.0) is None and row_weights(twice, 2.0) is None
    got = bake(model, data=weighted, options=BakeOptions(**{**vars(opts), "off_topic_weight": 2.0}))
    want = bake(model, data=twice, options=opts)
    plain = bake(model, data=weighted, options=opts)
    assert list(got.patch.deltas) == list(want.patch.deltas)
    moved = 0.0
    for name, d in want.patch.deltas.items():
        a, b = got.patch.deltas[name].dense(), d.dense()
        scale = float(b.abs().max()) or 1.0
        assert float((a - b).abs().max()) <= 1e-4 * scale, diff_msg(name, a, b)
        moved = max(moved, float((plain.patch.deltas[name].dense() - b).abs().max()) / scale)
    assert moved > 1e-3, f"weight 2 changed no delta (largest relative change {moved:.3g})"
    with pytest.raises(CtxcError, match="off_topic_weight must be above 0"):
        BakeOptions(off_topic_weight=0.0)
    with pytest.raises(CtxcError, match="off_topic_weight weighs the fit's or distillation's rows"):
        BakeOptions(off_topic_weight=2.0, method="additive")


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_off_topic_rows_held_to_the_model_alone_are_its_own_values(
    family: str,
) -> None:
    """``off_topic_targets="none"`` (issue 53): an off-topic row's targets become the unpatched
    model's own values on what the patched model is fed (prefix + row, no context), as the
    graph records them; every other row's are the full-context targets bit for bit; twice, the
    same."""
    from ctxc.bake.data import record_fit_targets
    from ctxc.bake.targets import cached_fit_targets, own_targets
    from ctxc.core.vocabulary import OFF_TOPIC_KINDS
    from ctxc.store.traced import traced_blocks

    model, tok = shared(family), tiny_tokenizer()
    traced, blocks = traced_blocks(model)
    ctx, prefix = [1, *random_ids(3, 20)], special_prefix(tok)
    rows = [random_ids(4, 6), random_ids(5, 7), random_ids(6, 5)]
    data = FitData(ctx, prefix, rows, ["file", "off-topic-text", "file"])
    full = cached_fit_targets(model, traced, blocks, data)
    got = own_targets(model, traced, blocks, data, full, OFF_TOPIC_KINDS)
    again = own_targets(model, traced, blocks, data, full, OFF_TOPIC_KINDS)
    p = len(prefix)
    mine = slice(p + 6, 2 * p + 13)  # the off-topic row's positions: its prefix and its 7 ids
    alone = record_fit_targets(traced, blocks, FitData(prefix, prefix, rows[1:2], ["x"]))
    changed = 0
    for path, tg in full.items():
        g = got[path]
        assert g.z.shape == tg.z.shape and g.y.shape == tg.y.shape, path
        for a, b in ((g.z, tg.z), (g.y, tg.y)):
            same = torch.ones(a.shape[0], dtype=torch.bool)
            same[mine] = False
            assert torch.equal(a[same], b[same]), f"{path}: a context row changed"
            changed += int((a[mine] != b[mine]).any(-1).sum())
        for a, b in ((g.z[mine], alone[path].z), (g.y[mine], alone[path].y)):
            scale = float(b.abs().max()) or 1.0
            assert float((a - b).abs().max()) <= 1e-4 * scale, diff_msg(path, a, b)
        assert torch.equal(g.y, again[path].y) and torch.equal(g.z, again[path].z), path
    assert changed == 2 * len(full) * (p + 7), f"{changed} rows changed, not the off-topic row's"

    with pytest.raises(CtxcError, match="off-topic target"):
        BakeOptions(off_topic_targets="nothing")


def test_a_bake_of_rows_held_to_the_model_alone_changes_nothing_there() -> None:
    """``off_topic_targets="none"``: a bake of one such row fits no change (the patched model's
    logits on it are the unpatched model's), where the context's targets move them. Llama: a
    post norm's eps is outside the stable rule's target (MATH.md 4), so at a tiny random
    model's small activations Gemma's post-norm moves are not zero where nothing should change
    (at a real model's, eps is a rounding)."""
    from ctxc.backends.onnx.export import patched_logits
    from ctxc.patch import Patch

    model, tok = shared("llama"), tiny_tokenizer()
    ctx, prefix, row = [1, *random_ids(3, 20)], special_prefix(tok), random_ids(5, 7)
    only = FitData(ctx, prefix, [row], ["off-topic-text"])
    opts = BakeOptions(rank=4, attention=None)
    held = bake(
        model, data=only, options=BakeOptions(**{**vars(opts), "off_topic_targets": "none"})
    )
    moved = bake(model, data=only, options=opts)
    ids = [torch.tensor([prefix + row])]
    base = patched_logits(model, Patch({}, held.patch.meta), ids)[0]
    same = patched_logits(model, held.patch, ids)[0]
    other = patched_logits(model, moved.patch, ids)[0]
    scale = float(base.abs().max())
    assert float((same - base).abs().max()) <= 1e-4 * scale, diff_msg("held", same, base)
    assert float((other - base).abs().max()) > 1e-2 * scale, diff_msg("context", other, base)
