"""What a `ctxc generate` step shares to cost less (issue 11), each shown to change no bit: the
decode step on a worker thread while the solver runs, the LM head's weights read once for both
runs (compiler/shared_head.py), and kept outputs reused instead of recomputed (reduced_run)."""

from __future__ import annotations

import dataclasses
import gc
from types import SimpleNamespace

import pytest
import torch
from helpers import diff_msg, random_ids
from tiny_models import build_any

import ctxc.generate as gen
import ctxc.shared_head as shared_head
from ctxc.passes import reduced_run
from ctxc.passes import solve as solve_mod
from ctxc.passes.run_graph import record_targets
from ctxc.passes.solve import solve
from ctxc.pipeline import traced_blocks

CONTEXT = random_ids(7, 18)


@pytest.fixture
def two_threads():
    """Two torch threads: the worker thread and the two-at-once head products need them."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _generate(model, monkeypatch, apply: str, plain: bool):
    """Steps and (patched, baseline) logits; ``plain``: no worker and no shared head."""
    seen, shares = [], []
    fidelity, head_share = gen.fidelity, gen.head_share

    def spy(a, b):
        seen.append((a.clone(), b.clone()))
        return fidelity(a, b)

    def share(*args):
        shares.append(None if plain else head_share(*args))
        return shares[-1]

    with monkeypatch.context() as m:
        m.setattr(gen, "fidelity", spy)
        m.setattr(gen, "head_share", share)
        if plain:  # the stepper sees one thread: no worker
            m.setattr(gen.torch, "get_num_threads", lambda: 1)
        result = gen.generate(model, CONTEXT, 4, update="stable", apply=apply)
    steps = [dataclasses.replace(s, seconds=0.0) for s in result.steps]
    return steps, seen, shares


# gemma3, llama, gpt2: the head is the graph's output, shared; gemma2 soft-caps its logits
# after the head (not shared, still on the worker); qwen2_moe: expert banks.
@pytest.mark.parametrize("family", ["gemma3", "llama", "gpt2", "gemma2", "qwen2_moe"])
@pytest.mark.parametrize("apply", ["lowrank", "baked"])
def test_shared_steps_are_the_plain_steps_bit_for_bit(
    family: str, apply: str, monkeypatch, two_threads
) -> None:
    model = build_any(family)
    want, want_logits, _ = _generate(model, monkeypatch, apply, plain=True)
    for _ in range(2):  # run twice: the same
        got, got_logits, shares = _generate(model, monkeypatch, apply, plain=False)
        assert (shares[0] is None) == (family == "gemma2"), shares
        assert got == want, f"steps differ:\n{got}\n{want}"
        for (a, b), (c, d) in zip(got_logits, want_logits, strict=True):
            assert torch.equal(a, c), diff_msg("patched logits, shared vs plain", a, c)
            assert torch.equal(b, d), diff_msg("baseline logits, shared vs plain", b, d)
    assert max(s.max_abs_logit_diff for s in got) <= 1e-5, got


def test_a_failing_decode_on_the_worker_is_raised(monkeypatch, two_threads) -> None:
    model = build_any("gemma3")

    def fail(self, current):
        raise RuntimeError("decode failed")

    monkeypatch.setattr(gen._Stepper, "_decode", fail)
    with pytest.raises(RuntimeError, match="decode failed"):
        gen.generate(model, CONTEXT, 2)
    assert not model.lm_head._forward_pre_hooks, "the head's hook was left registered"


def test_frozen_objects_are_released_and_a_callers_freeze_is_left(two_threads) -> None:
    model = build_any("llama")
    assert gc.get_freeze_count() == 0
    gen.generate(model, CONTEXT, 2)
    assert gc.get_freeze_count() == 0, "generate left objects frozen"
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        gen.generate(model, CONTEXT, 2)
        # (frozen objects freed by their reference count leave the count: not equal, but not 0)
        left = gc.get_freeze_count()
        assert left > frozen // 2, f"generate unfroze the caller's objects: {left} of {frozen}"
    finally:
        gc.unfreeze()


def test_head_share_refuses_other_bits_and_leaves_no_hook(monkeypatch) -> None:
    model = build_any("gemma3")
    traced, blocks = traced_blocks(model)
    probe = torch.tensor([CONTEXT[:8]])
    args = (model, traced, blocks, probe, gen._cache_arg(model), gen._cache_of, None)
    share = shared_head.head_share(*args)
    assert share is not None, "the tiny model's head is a plain linear whose output is the graph's"
    share.close()
    dual = shared_head.dual_linear
    monkeypatch.setattr(shared_head, "dual_linear", lambda *a: tuple(y + 1e-6 for y in dual(*a)))
    assert shared_head.head_share(*args) is None
    assert not model.lm_head._forward_pre_hooks


@pytest.mark.parametrize("rows", [1, 700, 30000])
def test_dual_linear_is_both_products(rows: int, two_threads) -> None:
    g = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(rows, 48, generator=g), torch.randn(rows, generator=g)
    x, y = torch.randn(1, 1, 48, generator=g), torch.randn(1, 1, 48, generator=g)
    with shared_head.ThreadPoolExecutor(1) as worker:
        for b in (None, bias):
            for pool in (None, worker):
                got = shared_head.dual_linear(x, y, w, b, pool)
                want = (torch.nn.functional.linear(x, w, b), torch.nn.functional.linear(y, w, b))
                for g_, w_ in zip(got, want, strict=True):
                    # Exact where the BLAS kernel splits the work alike (head_share checks it
                    # on the model before use); always within float32 rounding.
                    assert torch.allclose(g_, w_, rtol=1e-6, atol=1e-6), diff_msg("dual", g_, w_)
    assert torch.get_num_threads() == 2, "dual_linear left the thread count changed"


# olmo2: scale output move; gpt2: Conv1D (addmm, not reused); falcon: an in-place add_ after
# the MLP; mixtral: expert banks.
@pytest.mark.parametrize("family", ["olmo2", "gpt2", "falcon", "mixtral"])
@pytest.mark.parametrize("apply", ["lowrank", "baked"])
def test_reused_outputs_are_the_recomputed_ones(family: str, apply: str, monkeypatch) -> None:
    model = build_any(family)
    traced, blocks = traced_blocks(model)
    ids = torch.tensor([CONTEXT + random_ids(8, 2)])
    full = record_targets(traced, blocks, ids, 2)
    query = ids[:, len(CONTEXT) :]
    with monkeypatch.context() as m:  # as before: recompute every node an action is added to
        m.setattr(reduced_run.ReducedRun, "_plain_kept", lambda self, node: None)
        m.setattr(solve_mod, "aten", SimpleNamespace(linear=SimpleNamespace(default=None)))
        want = solve(traced, blocks, full, query, "stable", apply=apply)
    reused = []
    plain_kept = reduced_run.ReducedRun._plain_kept

    def spy(self, node):
        kept = plain_kept(self, node)
        reused.append(kept is not None)
        return kept

    for _ in range(2):
        got = solve(traced, blocks, full, query, "stable", apply=apply)
        assert torch.equal(got.logits, want.logits), diff_msg("reused", got.logits, want.logits)
        assert got.deltas.keys() == want.deltas.keys()
        for name, d in want.deltas.items():
            o = got.deltas[name]
            for a, b in ((d.u, o.u), (d.v, o.v), (d.vector, o.vector)):
                assert (a is None and b is None) or torch.equal(a, b), diff_msg(name, b, a)
    monkeypatch.setattr(reduced_run.ReducedRun, "_plain_kept", spy)
    solve(traced, blocks, full, query, "stable", apply=apply)
    if apply == "lowrank" and family == "olmo2":
        assert any(reused), "no kept output was reused"


def test_an_input_changed_in_place_is_recomputed() -> None:
    traced, blocks = traced_blocks(build_any("llama"))
    view = solve_mod.GraphView.of(traced)
    outer = view.by_name[blocks.blocks[0].outer.node]
    run = reduced_run.ReducedRun(view, [outer], traced.placeholder_values(torch.tensor([[5]])))
    with torch.no_grad():
        run.advance_to(outer)
        assert run._plain_kept(outer) is not None
        x = run.env[outer.all_input_nodes[0]]
        x.mul_(1.0)  # the same values, but changed in place: its version moves
        assert run._plain_kept(outer) is None
