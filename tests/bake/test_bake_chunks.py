"""Additive thought patches (issue 36): chunks added one by one equal a bake of them together,
removing one restores the patch before it, and the sums' solve is ``fit_linear``'s."""

from __future__ import annotations

import pytest
import torch

from ctxc.bake.chunks import bake_chunks, remove_chunk
from ctxc.bake.data import FitData, special_prefix
from ctxc.bake.driver import BakeOptions, bake
from ctxc.bake.evaluate import evaluate
from ctxc.bake.statistics import STATS_FILE, Statistics, solve_site
from ctxc.core.errors import CtxcError
from ctxc.passes.solver.fit_moves import FitOptions, fit_linear
from testbed.tiny_models import shared, tiny_tokenizer
from tests.fixtures.helpers import assert_gives_full, logits, random_ids

pytestmark = pytest.mark.tiny

ADDITIVE = BakeOptions(method="additive", rank=8)


def _chunks(n: int, seed: int = 0) -> list[FitData]:
    """``n`` chunks of fit data: a random context each, three random queries of 5-7 tokens."""
    prefix = special_prefix(tiny_tokenizer())
    out = []
    for c in range(n):
        ctx = [*prefix, *random_ids(seed + 100 * c, 12 + c)]
        queries = [random_ids(seed + 100 * c + 1 + i, 5 + i) for i in range(3)]
        out.append(FitData(ctx, prefix, queries, ["file"] * 3))
    return out


def _max_rel(a, b) -> float:
    """Max over the deltas of ``max |a - b| / max |b|`` (the dense deltas)."""
    assert list(a.deltas) == list(b.deltas)
    worst = 0.0
    for name, d in b.deltas.items():
        want, got = d.dense(), a.deltas[name].dense()
        worst = max(worst, float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30))
    return worst


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_chunks_one_by_one_equal_together(family: str) -> None:
    model = shared(family)
    datas = _chunks(3)
    together = bake_chunks(model, None, [], options=ADDITIVE, datas=datas)
    stats = None
    for data in datas:
        got = bake_chunks(model, None, [], options=ADDITIVE, start=stats, datas=[data])
        stats = got.stats
    assert stats is not None and stats.ids == together.stats.ids and len(stats.ids) == 3
    for key, total in together.stats.sums.items():
        diff = float((stats.sums[key] - total).abs().max())
        assert diff == 0.0, f"{key}: sums differ by {diff:.3g}"  # same terms, same order
    rel = _max_rel(got.patch, together.patch)
    assert rel == 0.0, f"patches differ: max relative {rel:.3g}"
    assert {d.rank for d in together.patch.deltas.values()} == {8}
    # The patch moves the fit data toward each chunk's full context.
    for data in datas:
        patched = evaluate(model, together.patch, data, gen_tokens=0)
        control = evaluate(model, None, data, gen_tokens=0)
        assert patched.kl < control.kl, f"KL patched {patched.kl:.3g} vs {control.kl:.3g}"


def test_removing_a_chunk_restores_the_patch(tmp_path) -> None:
    model = shared("gemma3")
    datas = _chunks(3, seed=7)
    two = bake_chunks(model, None, [], options=ADDITIVE, datas=datas[:2])
    three = bake_chunks(model, None, [], options=ADDITIVE, start=two.stats, datas=datas[2:])
    three.stats.save(tmp_path / STATS_FILE)
    loaded = Statistics.load(tmp_path / STATS_FILE)
    assert loaded.ids == three.stats.ids and loaded.options == three.stats.options
    last = loaded.ids[-1]
    back = remove_chunk(model, loaded, last)
    assert back.stats.ids == two.stats.ids
    rel = _max_rel(back.patch, two.patch)
    assert rel <= 1e-6, f"removing chunk {last}: max relative difference {rel:.3g} > 1e-6"
    assert _max_rel(three.patch, two.patch) > 1e-3  # the chunk did change the patch
    with pytest.raises(CtxcError, match="no chunk is 'nope'"):
        remove_chunk(model, loaded, "nope")
    with pytest.raises(CtxcError, match="in the patch already"):
        bake_chunks(model, None, [], start=loaded, datas=datas[:1])
    only = bake_chunks(model, None, [], options=ADDITIVE, datas=datas[:1])
    with pytest.raises(CtxcError, match="only one"):
        remove_chunk(model, only.stats, only.stats.ids[0])


def test_additive_patch_is_linear_and_refused_by_bake() -> None:
    """An additive patch moves linear weights only; ``bake`` points to ``bake_chunks``."""
    model = shared("gemma3")
    (data,) = _chunks(1, seed=3)
    got = bake_chunks(model, None, [], options=ADDITIVE, datas=[data])
    assert got.patch.meta.update == "bake-additive"
    assert all(d.vector is None for d in got.patch.deltas.values())
    # Gemma's sandwich blocks: the attention output projections carry it, the MLPs see v_C.
    assert all(name.endswith("self_attn.o_proj.weight") for name in got.patch.deltas)
    with pytest.raises(CtxcError, match="bake_chunks"):
        bake(model, data=data, options=ADDITIVE)
    with pytest.raises(CtxcError, match="refit_passes"):
        BakeOptions(method="additive", refit_passes=1)


def test_sums_solve_is_fit_linear() -> None:
    """The fit from X^T X, X^T Y and ||Y||^2 is fit_linear's from X and Y (ridge, rank)."""
    g = torch.Generator().manual_seed(0)
    for n, d_in, d_out in ((40, 12, 9), (6, 12, 9)):
        x = torch.randn(n, d_in, generator=g, dtype=torch.float64)
        y = torch.randn(n, d_out, generator=g, dtype=torch.float64)
        for ridge, rank in ((0.5, 3), (0.0, None), (1.0, 50)):
            want = fit_linear(x, y, FitOptions(ridge=ridge, rank=rank), "x")
            got = solve_site(x.T @ x, x.T @ y, float(y.pow(2).sum()), n, ridge, rank)
            dw_want, dw_got = want.u @ want.v.T, got.u @ got.v.T
            diff = float((dw_got - dw_want).abs().max()) / float(dw_want.abs().max())
            assert diff <= 1e-4, f"n={n} ridge={ridge} rank={rank}: relative diff {diff:.3g}"
            res = abs(got.rel_residual - want.rel_residual)
            assert res <= 1e-5, f"residual {got.rel_residual:.6g} vs {want.rel_residual:.6g}"


def test_one_position_additive_gives_the_full_context() -> None:
    """One fit position, ridge 0, no rank budget, no post norm (Llama): every teacher-forced
    move is exact, so the patched model meets the full run at that position (the forcing is
    what makes the blocks compose: without it each block would correct the whole gap again)."""
    import ctxc

    model = shared("llama")
    ids = random_ids(1, 20)
    exact = ctxc.compile(model, context_ids=ids[:-1], query_ids=ids[-1:])
    data = FitData(ids[:-1], [], [ids[-1:]], ["file"])
    opts = BakeOptions(method="additive", ridge=0.0, rank=None)
    got = bake_chunks(model, None, [], options=opts, datas=[data])
    assert_gives_full(model, got.patch, ids[-1:], exact, "additive llama vs full")


def test_one_position_additive_post_norm_is_near() -> None:
    """Gemma's post norms: a linear move reaches only the scale's sphere (the nearest point,
    the stable rule), and the additive fit moves no scale: near the full run, not at it."""
    import ctxc

    model = shared("gemma3")
    ids = random_ids(1, 20)
    exact = ctxc.compile(model, context_ids=ids[:-1], query_ids=ids[-1:])
    data = FitData(ids[:-1], [], [ids[-1:]], ["file"])
    opts = BakeOptions(method="additive", ridge=0.0, rank=None)
    got = bake_chunks(model, None, [], options=opts, datas=[data])
    diff = float((logits(model, ids[-1:], got.patch).float() - exact.full_logits).abs().max())
    control = exact.report.control.max_abs_logit_diff
    assert diff <= 0.05 * control, f"patched max |diff| {diff:.3g}, control {control:.3g}"
