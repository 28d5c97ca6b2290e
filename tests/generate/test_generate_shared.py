"""What makes a `ctxc generate` step cost less (issue 11), each shown to change no bit: the
decode step on a worker thread while the solver runs, the reduced run's LM head split between
two threads (compiler/generate/shared_head.py), and kept outputs reused instead of recomputed
(passes/runtime/reduced_run.py)."""

from __future__ import annotations

import dataclasses
import gc
from types import SimpleNamespace

import pytest
import torch

import ctxc.generate.shared_head as shared_head
import ctxc.generate.steps as gen
from ctxc.passes.runtime import reduced_run
from ctxc.passes.runtime.run_graph import record_targets
from ctxc.passes.solver import solve as solve_mod
from ctxc.passes.solver.solve import solve
from ctxc.store.traced import traced_blocks
from testbed.tiny_models import shared as shared_model
from tests.fixtures.helpers import diff_msg, random_ids

pytestmark = pytest.mark.tiny

CONTEXT = random_ids(7, 18)
# Each family's model is ``shared_model`` (built and traced once a session, seed 0 as
# ``build_any``): generate and solve leave a model as it was, and every check here compares runs
# on the one model, so building and tracing the same seeded model again per test checked nothing
# more (it was half of this file's time).


@pytest.fixture
def two_threads():
    """Two torch threads: the worker thread and the split head need them."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _generate(model, monkeypatch, apply: str, plain: bool):
    """Steps and (patched, baseline) logits; ``plain``: no worker, so no split head either."""
    seen, splits = [], []
    fidelity, head_split = gen.fidelity, gen.head_split

    def spy(a, b):
        seen.append((a.clone(), b.clone()))
        return fidelity(a, b)

    def split(*args):
        splits.append(head_split(*args))
        return splits[-1]

    with monkeypatch.context() as m:
        m.setattr(gen, "fidelity", spy)
        m.setattr(gen, "head_split", split)
        # The tiny models' heads have 128 rows: split them on a multiple of 32 rows.
        m.setattr(shared_head, "_ROW_MULTIPLE", 32)
        m.setattr(shared_head, "_MIN_ROWS", 64)
        if plain:  # the stepper sees one thread: no worker
            m.setattr(gen.torch, "get_num_threads", lambda: 1)
        result = gen.generate(model, CONTEXT, 4, update="stable", apply=apply)
    steps = [dataclasses.replace(s, seconds=0.0) for s in result.steps]
    return steps, seen, splits


# gemma3, llama, gpt2: the head is the graph's output; gemma2 soft-caps the head's output;
# qwen2_moe: expert banks.
@pytest.mark.parametrize("family", ["gemma3", "llama", "gpt2", "gemma2", "qwen2_moe"])
@pytest.mark.parametrize("apply", ["lowrank", "baked"])
def test_shared_steps_are_the_plain_steps_bit_for_bit(
    family: str, apply: str, monkeypatch, two_threads
) -> None:
    model = shared_model(family)
    want, want_logits, splits = _generate(model, monkeypatch, apply, plain=True)
    assert splits == [None], "no worker, yet the head was split"
    for _ in range(2):  # run twice: the same
        got, got_logits, splits = _generate(model, monkeypatch, apply, plain=False)
        # On this machine's BLAS the split rows give the whole product's bits (head_split
        # checks it; elsewhere it may refuse, and the head runs whole).
        assert splits[0] is not None, "the head split was refused: the kernel differs"
        assert got == want, f"steps differ:\n{got}\n{want}"
        for (a, b), (c, d) in zip(got_logits, want_logits, strict=True):
            assert torch.equal(a, c), diff_msg("patched logits, shared vs plain", a, c)
            assert torch.equal(b, d), diff_msg("baseline logits, shared vs plain", b, d)
    assert max(s.max_abs_logit_diff for s in got) <= 1e-5, got


def test_a_failing_decode_on_the_worker_is_raised(monkeypatch, two_threads) -> None:
    model = shared_model("gemma3")

    def fail(self, current):
        raise RuntimeError("decode failed")

    monkeypatch.setattr(gen._Stepper, "_decode", fail)
    with pytest.raises(RuntimeError, match="decode failed"):
        gen.generate(model, CONTEXT, 2)
    mlp = model.model.layers[0].mlp
    assert not mlp._forward_pre_hooks, "the target hooks were left registered"


def test_frozen_objects_are_released_and_a_callers_freeze_is_left(two_threads) -> None:
    model = shared_model("llama")
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


def test_head_split_is_refused_when_its_bits_differ(monkeypatch, two_threads) -> None:
    traced, blocks = traced_blocks(shared_model("gemma3"))
    monkeypatch.setattr(shared_head, "_ROW_MULTIPLE", 32)
    monkeypatch.setattr(shared_head, "_MIN_ROWS", 64)
    with shared_head.ThreadPoolExecutor(1) as worker:
        assert shared_head.head_split(traced, blocks, worker) is not None
        assert shared_head.head_split(traced, blocks, None) is None  # nothing to split with
        split = shared_head.split_linear
        monkeypatch.setattr(shared_head, "split_linear", lambda *a: split(*a) + 1e-6)
        assert shared_head.head_split(traced, blocks, worker) is None


@pytest.mark.parametrize("rows", [4096, 30000])
def test_split_linear_is_the_product(rows: int, two_threads) -> None:
    g = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(rows, 48, generator=g), torch.randn(rows, generator=g)
    x = torch.randn(1, 1, 48, generator=g)
    with shared_head.ThreadPoolExecutor(1) as worker:
        for b in (None, bias):
            got = shared_head.split_linear(x, w, b, worker)
            want = torch.nn.functional.linear(x, w, b)
            # Bit for bit on this machine's BLAS (head_split checks it before use elsewhere).
            assert torch.equal(got, want), diff_msg("split vs whole", got, want)
    assert torch.get_num_threads() == 2, "split_linear left the thread count changed"


# olmo2: scale output move; gpt2: Conv1D (addmm, not reused); falcon: an in-place add_ after
# the MLP; mixtral: expert banks.
@pytest.mark.parametrize("family", ["olmo2", "gpt2", "falcon", "mixtral"])
@pytest.mark.parametrize("apply", ["lowrank", "baked"])
def test_reused_outputs_are_the_recomputed_ones(family: str, apply: str, monkeypatch) -> None:
    model = shared_model(family)
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
    traced, blocks = traced_blocks(shared_model("llama"))
    view = solve_mod.GraphView.of(traced)
    outer = view.by_name[blocks.blocks[0].outer.node]
    run = reduced_run.ReducedRun(view, [outer], traced.placeholder_values(torch.tensor([[5]])))
    with torch.no_grad():
        run.advance_to(outer)
        assert run._plain_kept(outer) is not None
        x = run.env[outer.all_input_nodes[0]]
        x.mul_(1.0)  # the same values, but changed in place: its version moves
        assert run._plain_kept(outer) is None


# gpt2: Conv1D's in_out weights (no |W| kept: not contiguous as [out, in]); qwen2_moe: banks.
@pytest.mark.parametrize("family", ["gemma3", "llama", "gpt2", "qwen2_moe"])
@pytest.mark.parametrize("apply", ["lowrank", "baked"])
def test_kept_abs_weights_change_no_bit(family: str, apply: str, monkeypatch) -> None:
    model = shared_model(family)
    kept: list[dict] = []
    stepper_init = gen._Stepper.__init__

    def spy(self, *args, **kwargs):
        stepper_init(self, *args, **kwargs)
        kept.append(self.abs_memo.kept)

    monkeypatch.setattr(gen._Stepper, "__init__", spy)
    monkeypatch.setattr(gen, "_ABS_MEMO_BYTES", -1)  # none kept: |W| formed at every solve
    want, want_logits, _ = _generate(model, monkeypatch, apply, plain=True)
    assert kept == [{}], f"{len(kept[0])} |W| kept past a budget of -1 bytes"
    monkeypatch.setattr(gen, "_ABS_MEMO_BYTES", 1 << 30)
    kept.clear()
    for _ in range(2):  # run twice: the same
        got, got_logits, _ = _generate(model, monkeypatch, apply, plain=True)
        assert got == want, f"steps differ:\n{got}\n{want}"
        for (a, b), (c, d) in zip(got_logits, want_logits, strict=True):
            assert torch.equal(a, c), diff_msg("patched logits, |W| kept vs formed", a, c)
            assert torch.equal(b, d), diff_msg("baseline logits, |W| kept vs formed", b, d)
    _, blocks = traced_blocks(model)
    dense = family not in ("gpt2", "qwen2_moe")
    want_kept = len(blocks.blocks) if dense else 0
    assert len(kept[-1]) == want_kept, f"{len(kept[-1])} |W| kept, want {want_kept}"


# gemma3: post-norm scale; llama: plain linear output; gpt2: Conv1D (in_out) inner linear;
# olmo2: a norm after the outer linear; qwen2_moe: MoE blocks (not recorded: banks move first).
@pytest.mark.parametrize("family", ["gemma3", "llama", "gpt2", "olmo2", "qwen2_moe"])
@pytest.mark.parametrize("apply", ["lowrank", "baked"])
def test_input_moves_from_recorded_outputs(family: str, apply: str, monkeypatch) -> None:
    """``u = W z_C - W z`` from the full run's recorded inner outputs: every inner linear still
    moved, the patched logits those of ``W (z_C - z)`` up to rounding, and with ``lowrank``
    the inner linears' outputs are not computed a second time (their weights read once)."""
    model = shared_model(family)
    traced, blocks = traced_blocks(model)
    ids = torch.tensor([CONTEXT + random_ids(9, 1)])
    query = ids[:, len(CONTEXT) :]
    full = record_targets(traced, blocks, ids, 1, inner=True)
    plain = dataclasses.replace(
        full, targets={p: dataclasses.replace(t, inner=None) for p, t in full.targets.items()}
    )
    recorded = sum(len(t.inner or {}) for t in full.targets.values())
    sites = [s for b in blocks.blocks if b.experts is None for s in b.inner if not s.experts]
    assert recorded == len(sites) and (recorded > 0) == (family != "qwen2_moe"), recorded
    want = solve(traced, blocks, plain, query, "stable", apply=apply)
    computed: list[str] = []
    compute = reduced_run.ReducedRun._compute

    def spy(self, node):
        computed.append(node.name)
        return compute(self, node)

    products: list[int] = []
    input_moves = solve_mod.moves.input_moves

    def multiplied(weights, z, z_target):
        products.append(len(weights))
        return input_moves(weights, z, z_target)

    monkeypatch.setattr(reduced_run.ReducedRun, "_compute", spy)
    monkeypatch.setattr(solve_mod.moves, "input_moves", multiplied)
    for _ in range(2):  # run twice: the same
        computed.clear()
        products.clear()
        got = solve(traced, blocks, full, query, "stable", apply=apply, inner_outputs=True)
        # Only the MoE blocks' shared linears are still multiplied.
        shared = [s for b in blocks.blocks if b.experts for s in b.inner if not s.experts]
        assert sum(products) == len(shared), (products, len(shared))
        assert got.deltas.keys() == want.deltas.keys()
        for s in sites:  # the same moves, up to the rounding of the two ways
            a, b = got.deltas[s.weight].u, want.deltas[s.weight].u
            assert torch.allclose(a, b, rtol=0, atol=1e-4 * float(b.abs().max())), diff_msg(
                s.weight, a, b
            )
        scale = float(want.logits.abs().max())
        assert torch.allclose(got.logits, want.logits, rtol=0, atol=1e-5 * scale), diff_msg(
            "patched logits, recorded vs multiplied", got.logits, want.logits
        )
        again = {s.node for s in sites} & set(computed)
        if apply == "lowrank":
            assert not again, f"inner outputs computed again: {sorted(again)}"
