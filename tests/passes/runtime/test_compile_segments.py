"""Compiled segments of the reduced run (issue 11): the same values, bit for bit, as the
node-by-node interpreter, for every way the solver puts a patch in place."""

from __future__ import annotations

import pytest
import torch

from ctxc.passes.runtime import reduced_run
from ctxc.passes.runtime.compile_segments import compile_segments, compiled
from ctxc.passes.runtime.run_graph import record_targets
from ctxc.passes.solver.solve import solve
from ctxc.store.traced import traced_blocks
from testbed.tiny_models import shared
from tests.fixtures.helpers import diff_msg, max_diff, random_ids

pytestmark = pytest.mark.tiny

CONTEXT, QUERY = random_ids(21, 10), random_ids(22, 2)


# olmo2: scale output move (post norms); gpt2: Conv1D layout, linear move; falcon: an in-place
# add_ after the MLP; mixtral: expert banks (bank actions, router stops).
@pytest.mark.parametrize("family", ["olmo2", "gpt2", "falcon", "mixtral"])
def test_compiled_runs_match_the_interpreter(family: str, monkeypatch) -> None:
    model = shared(family)
    traced, blocks = traced_blocks(model)
    ids = torch.tensor([CONTEXT + QUERY])
    full = record_targets(traced, blocks, ids, len(QUERY))
    query = ids[:, len(CONTEXT) :]
    for apply in ("lowrank", "baked"):
        with monkeypatch.context() as m:  # node by node, as before compiled stretches
            m.setattr(reduced_run, "compile_segments", lambda gm, stops: None)
            want = solve(traced, blocks, full, query, "stable", apply=apply)
        for _ in range(2):  # the first request of these stops compiles them for the next
            got = solve(traced, blocks, full, query, "stable", apply=apply)
        _check_same(want, got, full.logits)
    sets = compiled(traced.graph_module)
    assert len(sets) == 1, f"{len(sets)} sets of stretches compiled (one expected)"
    covered = sum(len(seg.nodes) for seg in sets[0].values())
    total = len(traced.graph.nodes)
    assert covered > total // 2, f"only {covered} of {total} nodes in compiled stretches"


def _check_same(want, got, full) -> None:
    """Bit for bit the interpreter's logits and deltas; exact against the full run."""
    assert torch.equal(want.logits, got.logits), diff_msg(
        "compiled vs node by node", got.logits, want.logits
    )
    assert want.deltas.keys() == got.deltas.keys()
    for name, d in want.deltas.items():
        other = got.deltas[name]
        for a, b in ((d.u, other.u), (d.v, other.v), (d.vector, other.vector)):
            assert (a is None and b is None) or torch.equal(a, b), diff_msg(name, b, a)
    assert max_diff(got.logits, full) < 1e-4, diff_msg("patched vs full", got.logits, full)


def test_first_request_compiles_nothing() -> None:
    traced, _ = traced_blocks(shared("gpt2"))
    stops = frozenset(list(traced.graph.nodes)[:3])
    assert compile_segments(traced.graph_module, stops) is None
    assert compile_segments(traced.graph_module, stops)
