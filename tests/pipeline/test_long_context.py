"""Long contexts on a tiny Gemma 3: the full run's banded attention and the lean verification."""

from __future__ import annotations

import pytest
import torch

import ctxc
from ctxc.passes.runtime import run_graph
from ctxc.passes.runtime.run_graph import record_targets
from ctxc.runs.patched_forward import patched_logits
from ctxc.store.traced import traced_blocks
from testbed.tiny_models import build
from tests.fixtures.helpers import diff_msg, random_ids

pytestmark = pytest.mark.tiny

N = 2000  # past one query chunk (1792 rows), so the full run bands its attention


@pytest.fixture(scope="module")
def long_gemma() -> torch.nn.Module:
    """The tiny Gemma 3 (sliding, full, sliding) taking 4096 positions, window 300."""
    model = build("gemma3")
    model.config.max_position_embeddings = 4096
    model.config.sliding_window = 300
    return model


def test_full_run_bands_attention_bit_for_bit(long_gemma, monkeypatch) -> None:
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[4])
        return banded_sdpa(*args, **kwargs)

    banded_sdpa = run_graph.banded_sdpa
    monkeypatch.setattr(run_graph, "banded_sdpa", counted)
    ids = torch.tensor([random_ids(3, N)])
    traced, blocks = traced_blocks(long_gemma)
    full = record_targets(traced, blocks, ids, 1)
    assert len(calls) == 3, f"{len(calls)} attention calls banded, expected 3"
    sliding = [b for b in calls if b[-1].keys[1] - b[-1].keys[0] < N]
    assert sliding, "no band narrower than the context: the sliding window was not used"
    monkeypatch.setattr(run_graph, "usable", lambda *_a: False)  # the whole calls, as before
    whole = record_targets(traced, blocks, ids, 1)
    assert torch.equal(full.logits, whole.logits), diff_msg("banded", full.logits, whole.logits)
    for path, t in whole.targets.items():
        assert torch.equal(full.targets[path].y, t.y), diff_msg(path, full.targets[path].y, t.y)
    with torch.no_grad():  # the model's own forward, the head on the last position as here
        want = long_gemma(input_ids=ids, logits_to_keep=1).logits[0].float()  # [1, vocab]
    assert torch.equal(full.logits, want), diff_msg("full run vs forward", full.logits, want)


def test_long_compile_is_exact_and_verifies_lean(long_gemma) -> None:
    before = {k: (v.data_ptr(), v.clone()) for k, v in long_gemma.state_dict().items()}
    result = ctxc.compile(long_gemma, context_ids=random_ids(4, N))
    rep = result.report
    msg = f"emitted {rep.emitted.max_abs_logit_diff:.3g}, "
    msg += f"control {rep.control.max_abs_logit_diff:.3g}"
    assert rep.emitted.max_abs_logit_diff <= 1e-5 and rep.emitted.top1_match, msg
    assert rep.control.max_abs_logit_diff > 1e-2, "control too close: the test cannot fail; " + msg
    query = torch.tensor([result.patch.meta.query_ids])
    lean = patched_logits(long_gemma, result.patch, query)
    with result.patch.applied(long_gemma), torch.no_grad():
        applied = long_gemma(input_ids=query).logits[0].float()
    assert torch.equal(lean, applied), diff_msg("patched_logits vs Patch.applied", lean, applied)
    after = long_gemma.state_dict()
    moved = [k for k, (ptr, v) in before.items() if after[k].data_ptr() != ptr]
    changed = [k for k, (_, v) in before.items() if not torch.equal(after[k], v)]
    assert not moved and not changed, f"model left modified: {moved[:2]} {changed[:2]}"


def test_too_long_context_is_one_line_naming_both_numbers(long_gemma) -> None:
    with pytest.raises(ctxc.CtxcError, match=r"4097 tokens.*at most 4096 positions"):
        ctxc.compile(long_gemma, context_ids=random_ids(5, 4097))
