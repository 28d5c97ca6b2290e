"""The ridge's prior (``BakeOptions.prior``, ``ctxc.bake.prior``; issue 53): the fit's ridge
measured by where unrelated text's inputs lie, ``lam tr(dW M dW^T)``."""

from __future__ import annotations

import pytest
import torch

from ctxc.bake.data import FitData, special_prefix
from ctxc.bake.driver import BakeOptions, bake
from ctxc.bake.prior import input_priors, moved_linears
from ctxc.core.errors import CtxcError
from ctxc.passes.solver.fit_moves import FitOptions, fit_linear
from ctxc.store.traced import traced_blocks
from testbed.tiny_models import shared, tiny_tokenizer
from tests.fixtures.helpers import diff_msg, random_ids


def _dense(fit) -> torch.Tensor:
    return fit.u @ fit.v.T  # [out, in]


@pytest.mark.parametrize("n", [5, 40])  # the kernel form (N <= in) and the primal one
@pytest.mark.parametrize("out", [6, 24])  # narrower and wider than the input
def test_the_identity_prior_is_the_plain_ridge(n: int, out: int) -> None:
    """``M = I`` is the plain ridge whichever form the plain fit takes, at every rank."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 12, generator=g), torch.randn(n, out, generator=g)
    for rank in (None, 3):
        opts = FitOptions(ridge=0.5, rank=rank)
        plain, got = fit_linear(x, y, opts, "x"), fit_linear(x, y, opts, "x", torch.eye(12))
        a, b = _dense(got), _dense(plain)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), diff_msg(f"rank {rank}", a, b)
        assert abs(got.rel_residual - plain.rel_residual) < 1e-5, (got, plain)


def test_a_prior_on_a_direction_moves_that_direction_less_and_fits_no_worse_elsewhere() -> None:
    """A metric heavy on one input direction ``k`` charges the move by ``|dW k|``: the prior's
    move changes ``k``'s output less than the plain ridge's, and its residual is still a
    ridge's (no larger than the unfitted 1)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(30, 8, generator=g), torch.randn(30, 5, generator=g)
    k = torch.zeros(8)
    k[2] = 1.0
    metric = 0.2 * torch.eye(8) + 0.8 * 8 * torch.outer(k, k)  # trace 8
    opts = FitOptions(ridge=1.0, rank=None)
    plain, got = fit_linear(x, y, opts, "x"), fit_linear(x, y, opts, "x", metric)
    moved, kept = float((_dense(got) @ k).norm()), float((_dense(plain) @ k).norm())
    assert moved < 0.5 * kept, f"|dW k| {moved:.4g} with the prior, {kept:.4g} without"
    assert got.rel_residual < 1.0, got.rel_residual


@pytest.mark.tiny
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_input_priors_are_the_inputs_second_moments(family: str) -> None:
    """One metric per moved linear, [in, in], symmetric, trace ``in``; at share 1 the named
    linear's own inputs' second moment on the samples (recomputed here by a hook), and the
    identity share below it; the model is left as it was (no hook stays)."""
    model, tok = shared(family), tiny_tokenizer()
    _, blocks = traced_blocks(model)
    names = moved_linears(blocks, attention=True)
    assert len(names) >= 2 * len(blocks.blocks), names
    prefix = special_prefix(tok)
    full = input_priors(model, prefix, names, 1.0, seed=0, samples=4, tokens=6)
    half = input_priors(model, prefix, names, 0.5, seed=0, samples=4, tokens=6)
    for name in names:
        m = full[name]
        d = m.shape[0]
        assert m.shape == (d, d) and torch.allclose(m, m.T), name
        assert abs(float(torch.diagonal(m).sum()) - d) < 1e-4 * d, name
        want = 0.5 * torch.eye(d) + 0.5 * m
        assert torch.allclose(half[name], want, atol=1e-6), diff_msg(name, half[name], want)
    assert all(not mod._forward_pre_hooks for mod in model.modules()), "a hook stayed"
    again = input_priors(model, prefix, names, 1.0, seed=0, samples=4, tokens=6)
    assert all(torch.equal(again[n], full[n]) for n in names), "not the same twice"


@pytest.mark.tiny
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_bake_with_the_prior_moves_less_on_the_models_own_text(family: str) -> None:
    """``BakeOptions(prior=1.0)``: the deltas change, the same twice, and on inputs of the
    model's own text (what the prior measured) the moved linears change their outputs less in
    sum than the plain ridge's; ``prior=0`` is the plain bake; bad values refuse in one line."""
    model, tok = shared(family), tiny_tokenizer()
    ctx = [1, *random_ids(3, 20)]
    prefix = special_prefix(tok)
    data = FitData(ctx, prefix, [random_ids(4, 6), random_ids(5, 7)], ["file", "file"])
    opts = BakeOptions(rank=4, attention=None)
    plain = bake(model, data=data, options=opts)
    zero = bake(model, data=data, options=BakeOptions(**{**vars(opts), "prior": 0.0}))
    got = bake(model, data=data, options=BakeOptions(**{**vars(opts), "prior": 1.0}))
    twice = bake(model, data=data, options=BakeOptions(**{**vars(opts), "prior": 1.0}))
    assert got.report["timings"]["prior"] >= 0 and "prior" not in plain.report["timings"]
    _, blocks = traced_blocks(model)
    priors = input_priors(model, prefix, moved_linears(blocks, True), 1.0, seed=0)
    with_prior, without = 0.0, 0.0
    for name, d in plain.patch.deltas.items():
        assert torch.equal(zero.patch.deltas[name].dense(), d.dense()), name
        assert torch.equal(twice.patch.deltas[name].dense(), got.patch.deltas[name].dense())
        if name not in priors:
            continue
        m = priors[name].float()  # E[k k^T]: sum of |dW k|^2 = tr(dW M dW^T)
        for delta, acc in ((got.patch.deltas[name], "with"), (d, "without")):
            w = delta.dense() if delta.layout == "out_in" else delta.dense().T  # [out, in]
            cost = float(torch.einsum("oi,ij,oj->", w, m, w))
            with_prior, without = (
                (with_prior + cost, without) if acc == "with" else (with_prior, without + cost)
            )
    assert with_prior < without, f"E|dW k|^2 summed: {with_prior:.4g} with, {without:.4g} without"
    with pytest.raises(CtxcError, match="prior must be between 0 and 1"):
        BakeOptions(prior=1.5)
    with pytest.raises(CtxcError, match="prior is the fit's ridge metric"):
        BakeOptions(prior=0.5, method="additive")
