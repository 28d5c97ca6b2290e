"""Thought-patch evaluation and the reuse the benchmark relies on (issue 13): the shared
reference and the teacher-forced matched count against direct runs, reused fit targets, the
fit's fast linear algebra against its definition, and distill's time budget."""

from __future__ import annotations

import pytest
import torch

from ctxc.bake.data import FitData, record_fit_targets, special_prefix
from ctxc.bake.driver import BakeOptions, bake
from ctxc.bake.evaluate import (
    evaluate_against,
    evaluate_many,
    evaluate_scoped,
    greedy,
    log_probabilities,
    position_figures,
    reference,
)
from ctxc.bake.targets import cached_fit_targets
from ctxc.passes.solver.fit_moves import FitOptions, LsInput, fit_linear
from ctxc.passes.solver.fit_solve import _same_inner_products, effective_rank
from ctxc.store.traced import traced_blocks
from testbed.tiny_models import shared, tiny_tokenizer
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import diff_msg, random_ids

pytestmark = pytest.mark.tiny


def _data(seed: int, lengths: list[int]) -> FitData:
    queries = [random_ids(seed + i, n) for i, n in enumerate(lengths)]
    prefix = special_prefix(tiny_tokenizer())
    return FitData([1, *random_ids(seed, 14)], prefix, queries, ["file"] * len(lengths))


def _direct(model, patch, data: FitData, gen: int):
    """The figures the slow way: the full input run whole, both sides generating greedily."""
    kls, agrees, matched = [], [], []
    with torch.no_grad():
        for i in range(len(data.queries)):
            k = len(data.reduced(i))
            full = model(input_ids=torch.tensor([data.full(i)])).logits[0, -k:]
            want = greedy(model, data.full(i), gen)
            with patch.applied(model):
                got = model(input_ids=torch.tensor([data.reduced(i)])).logits[0]
                picks = greedy(model, data.reduced(i), gen)
            kl, agree = position_figures(got, full)
            kls.append(kl)
            agrees.append(agree)
            n = next((j for j, (a, b) in enumerate(zip(picks, want, strict=True)) if a != b), gen)
            matched.append(n)
    return torch.cat(kls), torch.cat(agrees), matched


def test_position_figures_in_float32_are_the_float64_ones_to_3e_5() -> None:
    """Over Gemma 3's vocabulary (262,144 tokens): float32 log-probabilities with a float64
    sum give float64's KL to 3e-5 (a bake's KL is 0.01-3, printed to three places), the same
    top-1, exactly 0 for equal inputs, and the same figures from precomputed log-probabilities."""
    gen = torch.Generator().manual_seed(0)
    full = 3 * torch.randn(5, 262_144, generator=gen)  # [k, vocab]
    for noise in (1.0, 0.1, 0.01):
        patched = full + noise * torch.randn(full.shape, generator=gen)
        kl, agree = position_figures(patched, full)
        lf, lp = full.double().log_softmax(-1), patched.double().log_softmax(-1)
        want = (lf.exp() * (lf - lp)).sum(-1)  # [k], float64 all through
        assert torch.allclose(kl, want, rtol=1e-4, atol=3e-5), diff_msg("KL", kl, want)
        assert torch.equal(agree, patched.argmax(-1) == full.argmax(-1))
        again, same = position_figures(patched, full.log_softmax(-1), full_logprobs=True)
        assert torch.equal(again, kl) and torch.equal(same, agree), diff_msg("KL", again, kl)
    zero, _ = position_figures(full, full)
    assert torch.equal(zero, torch.zeros(5, dtype=torch.float64)), zero


@pytest.mark.parametrize("gen", [4, 0])
def test_evaluate_many_with_shared_log_probabilities_is_each_patch_alone(gen: int) -> None:
    """:func:`evaluate_many` normalises each reference once for all its patches
    (:func:`log_probabilities`): the figures of each patch are :func:`evaluate_against`'s."""
    model = shared("gemma3")
    data = _data(70, [3, 7, 5])
    patch = bake(model, data=data, options=BakeOptions(rank=2, ridge=1e-3)).patch
    got = evaluate_many(model, [patch, None], data, gen)
    ref = reference(model, data, gen_tokens=gen)
    assert log_probabilities(ref).logits[0].shape == ref.logits[0].shape
    for one, p in zip(got, [patch, None], strict=True):
        want = evaluate_against(model, p, ref)
        assert abs(one.kl - want.kl) <= 1e-6 * max(want.kl, 1e-3), diff_msg("KL", one.kl, want.kl)
        assert (one.top1, one.matched_all) == (want.top1, want.matched_all), (one, want)
    assert got[0].kl < got[1].kl, (got[0].kl, got[1].kl)


def test_scoped_figures_take_each_query_from_the_patch_or_the_control() -> None:
    """:func:`evaluate_scoped` (issue 53): every query in scope gives the patch's figures, none
    the control's, and a mix the patch's matched tokens on the queries in scope, the control's
    on the others, with KL and top-1 pooled over the positions of each."""
    model = shared("gemma3")
    data = _data(90, [3, 7, 5])
    patch = bake(model, data=data, options=BakeOptions(rank=2, ridge=1e-3)).patch
    p, c = evaluate_many(model, [patch, None], data, 4)
    for on, want in (([True] * 3, p), ([False] * 3, c)):
        got = evaluate_scoped(model, patch, data, on, 4)
        assert got[0] == p and got[1] == c and got[2] == want, (got, want)
    _, _, mixed = evaluate_scoped(model, patch, data, [True, False, True], 4)
    assert mixed.matched_all == [p.matched_all[0], c.matched_all[1], p.matched_all[2]], mixed
    assert min(p.kl, c.kl) <= mixed.kl <= max(p.kl, c.kl) and mixed.positions == p.positions
    with pytest.raises(ValueError, match="2 scope decisions for 3 queries"):
        evaluate_scoped(model, patch, data, [True, False], 4)


@pytest.mark.parametrize(("family", "gen"), [("llama", 6), ("gemma3", 6), ("gemma3", 0)])
def test_shared_reference_and_teacher_forced_count_match_direct_runs(family: str, gen: int):
    """Queries of three lengths in a batch of two (right padding; the reference batches the
    equal lengths, or all of them right-padded without generation): the same KL, top-1 and
    free-generation count as running every input whole and generating on both sides."""
    model = shared(family)
    data = _data(50, [3, 7, 5, 7, 3])
    patch = bake(
        model, data=data, options=BakeOptions(rank=2, ridge=1e-3, scale_ridge=1e-3, fit_prefix=True)
    ).patch
    ref = reference(model, data, gen_tokens=gen)
    got = evaluate_against(model, patch, ref, batch=2)
    kl, agree, matched = _direct(model, patch, data, gen)
    assert got.positions == kl.numel() == data.positions
    assert abs(got.kl - float(kl.mean())) <= 1e-5 * max(float(kl.mean()), 1.0), diff_msg(
        "mean KL", got.kl, kl.mean()
    )
    assert got.top1 == float(agree.double().mean()), (got.top1, float(agree.double().mean()))
    assert got.matched_all == matched, (got.matched_all, matched)
    control = evaluate_against(model, None, ref, batch=2)
    # The patch is applied in the evaluation: its figures are not the control's.
    assert got.kl < 0.5 * control.kl, f"control {control.kl:.4g}, patched {got.kl:.4g}"


def test_reused_targets_of_a_longer_set_give_the_same_patch() -> None:
    """The benchmark records the full runs once at the largest K and slices them."""
    model = shared("gemma3")
    data = _data(60, [4, 6, 5, 3])
    traced, blocks = traced_blocks(model)
    targets = cached_fit_targets(model, traced, blocks, data)
    two = data.part(0, 2)
    n = two.positions
    sliced = {p: t.leading(n) for p, t in targets.items()}
    opts = BakeOptions(rank=3)
    again = bake(model, data=two, targets=sliced, options=opts).patch
    fresh = bake(model, data=two, options=opts).patch
    assert list(again.deltas) == list(fresh.deltas)
    for name, d in fresh.deltas.items():
        got, want = again.deltas[name].dense(), d.dense()
        assert torch.equal(got, want), diff_msg(name, got, want)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cached_targets_are_the_graph_s_up_to_rounding(family: str, monkeypatch) -> None:
    """One context run, its cache continued by batches of equal-length queries: every block's
    z, y (and Gemma's v, the residual after the attention) at every fit position as the graph
    records them query by query; a failed check on the first query falls back to the graph's
    recording (bit for bit)."""
    model = shared(family)
    data = _data(70, [4, 6, 4, 4, 6])
    traced, blocks = traced_blocks(model)
    want = record_fit_targets(traced, blocks, data)
    got = cached_fit_targets(model, traced, blocks, data)
    assert list(got) == list(want)
    with_v = [p for p, tg in want.items() if tg.v is not None]
    assert len(with_v) == (len(want) if family == "gemma3" else 0), with_v
    for path, tg in want.items():
        pairs = [(got[path].z, tg.z), (got[path].y, tg.y)]
        if tg.v is not None:
            assert got[path].v is not None, path
            pairs.append((got[path].v, tg.v))
        for a, b in pairs:
            assert a.shape == b.shape, (path, a.shape, b.shape)
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), diff_msg(path, a, b)
    monkeypatch.setattr("ctxc.bake.targets.CHECK_TOL", -1.0)
    fallback = cached_fit_targets(model, traced, blocks, data)
    for path, tg in want.items():
        assert torch.equal(fallback[path].y, tg.y), diff_msg(path, fallback[path].y, tg.y)


@pytest.mark.parametrize(("n", "ridge"), [(40, 0.1), (40, 0.0), (5, 0.1)])
def test_fit_linear_is_the_reduced_rank_ridge_fit(n: int, ridge: float) -> None:
    """Wide outputs (the QR path when N > in) and the Cholesky solve give the definition:
    the ridge solution projected on the top-R right singular vectors of its fitted values."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 6, generator=g), torch.randn(n, 15, generator=g)
    fit = fit_linear(x, y, FitOptions(ridge=ridge, rank=3), "x")
    xd, yd = x.double(), y.double()
    lam = ridge * float(xd.pow(2).sum()) / 6
    b = torch.linalg.lstsq(
        torch.cat([xd, lam**0.5 * torch.eye(6, dtype=xd.dtype)]),
        torch.cat([yd, torch.zeros(6, 15, dtype=yd.dtype)]),
    ).solution  # [in, out]
    vh = torch.linalg.svd(xd @ b, full_matrices=False).Vh[:3]  # [3, out]
    want = b @ vh.T @ vh  # dW^T [in, out]
    got = fit.v.double() @ fit.u.double().T
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-5 * scale, diff_msg("dW^T", got, want)


def test_effective_rank_is_the_participation_ratio_of_the_eigenvalues() -> None:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(30, 8, generator=g), torch.randn(30, 5, generator=g)
    gram = (a.double() @ a.double().T) * (b.double() @ b.double().T)
    ev = torch.linalg.eigvalsh(gram).clamp_min(0)
    want = float(ev.sum() ** 2 / ev.pow(2).sum())
    # float32 Grams, float64 sums (fit_solve.effective_rank): a few float32 roundings.
    assert abs(effective_rank(a, b) - want) <= 1e-6 * want, (effective_rank(a, b), want)
    assert 1.0 < want < 30.0


@needs_extra("peft")
def test_distill_under_a_time_budget_reports_its_steps() -> None:
    model = shared("llama")
    data = _data(70, [4, 5])
    run = bake(model, data=data, options=BakeOptions(method="distill", rank=2, distill_steps=3))
    assert run.report["distill"]["steps"] == 3, run.report["distill"]
    # A budget far below one step's time still takes one step, and says so.
    opts = BakeOptions(method="distill", rank=2, distill_seconds=1e-9)
    timed = bake(model, data=data, options=opts).report["distill"]
    assert timed["steps"] == 1 and timed["seconds"] > 0, timed


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_teacher_from_the_shared_context_run_is_the_direct_one(family: str) -> None:
    """The distillation teacher from one context run per chunk (12 queries: two chunks, three
    lengths): the top tokens and log-probabilities of running each full input whole."""
    from ctxc.bake.distill import TOP, teacher_top

    model = shared(family)
    data = _data(70, [3, 7, 5, 7, 3, 4, 4, 6, 2, 7, 3, 5])
    got = teacher_top(model, data)
    assert len(got) == len(data.queries)
    with torch.no_grad():
        for i, (logp, ids) in enumerate(got):
            k = len(data.reduced(i))
            full = model(input_ids=torch.tensor([data.full(i)])).logits[0, -k:].float()
            want = full.log_softmax(-1)  # [k, vocab]
            assert logp.shape == ids.shape == (k, min(TOP, want.shape[-1]))
            at = want.gather(-1, ids)  # the direct log-probabilities of the tokens kept
            assert torch.allclose(logp, at, atol=1e-4), diff_msg(f"query {i}", logp, at)
            best = want.topk(ids.shape[-1], dim=-1).values
            assert torch.allclose(logp, best, atol=1e-4), diff_msg(f"query {i} top", logp, best)


def test_shared_input_fits_are_the_separate_fits_and_the_residual_from_sums_is_direct() -> None:
    """Two fits over one LsInput (the gate and up projections' z) give the same bits as two
    fits of their own; the wide-output residual from X^T X and X^T Y is the direct one."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(60, 7, generator=g)
    ys = [torch.randn(60, 19, generator=g), torch.randn(60, 19, generator=g)]
    shared_x = LsInput(x)
    for y in ys:
        for opts in (FitOptions(ridge=0.5, rank=3), FitOptions(ridge=1.0)):
            own, got = fit_linear(x, y, opts, "x"), fit_linear(shared_x, y, opts, "x")
            assert torch.equal(own.u, got.u) and torch.equal(own.v, got.v), opts
            dw = got.u.double() @ got.v.double().T  # [out, in]
            direct = float((x.double() @ dw.T - y.double()).norm() / y.double().norm())
            gap = abs(got.rel_residual - direct)
            assert gap <= 1e-6, f"residual from sums {got.rel_residual:.9g} vs direct {direct:.9g}"


def test_effective_rank_through_the_cholesky_factor_is_the_same() -> None:
    """The gate's want ``D W^T`` (out > in) has the inner products of ``D L``, ``L L^T = W^T
    W``: the same participation ratio at N^2 in instead of N^2 out; out <= in keeps ``D W^T``."""
    g = torch.Generator().manual_seed(4)
    d, z = torch.randn(50, 6, generator=g), torch.randn(50, 6, generator=g)
    wide, narrow = torch.randn(20, 6, generator=g), torch.randn(4, 6, generator=g)
    want = effective_rank(d @ wide.T, z)
    got = effective_rank(_same_inner_products(d, wide, d @ wide.T), z)
    assert _same_inner_products(d, wide, d @ wide.T).shape == (50, 6)
    assert abs(got - want) <= 1e-5 * want, (got, want)
    dw = d @ narrow.T
    assert _same_inner_products(d, narrow, dw) is dw
