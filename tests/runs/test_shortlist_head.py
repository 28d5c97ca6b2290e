"""The decode loops' bfloat16 head (compiler/runs/shortlist_head.py): what it changes, exactness
of the shortlisted tokens and of the greedy pick, and that it leaves other heads alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ctxc.runs import shortlist_head as sh
from tests.fixtures.helpers import diff_msg


class _Head(torch.nn.Module):
    def __init__(self, vocab: int, d: int, bias: bool = False, dtype=torch.float32) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(d, vocab, bias=bias, dtype=dtype)
        torch.nn.init.normal_(self.lm_head.weight, std=0.05)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


def _states(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, d, generator=g) * 20  # [n, 1, d], logits spread over ~30


def test_head_changed_in_the_block_only():
    model = _Head(40_000, 48)
    head = model.lm_head
    with sh.shortlist_head(model) as changed:
        assert changed and "forward" in vars(head)
    assert "forward" not in vars(head), "the head's forward was left replaced"
    with pytest.raises(RuntimeError), sh.shortlist_head(model):
        raise RuntimeError("inside")
    assert "forward" not in vars(head), "an error left the head's forward replaced"


@pytest.mark.parametrize("seed", [0, 1])
def test_top_exact_and_greedy_pick_kept(seed):
    model = _Head(40_000, 48)
    x = _states(12, 48, seed)
    w = model.lm_head.weight
    with torch.no_grad():
        want = F.linear(x, w)  # [12, 1, vocab]
        with sh.shortlist_head(model):
            got = model.lm_head(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got.argmax(-1), want.argmax(-1)), "the greedy pick moved"
    near = want >= want.amax(-1, keepdim=True) - sh.MARGIN + 1.0  # inside the margin, surely
    gap = (got - want)[near].abs()
    msg = diff_msg("shortlisted logits", got[near], want[near])
    assert gap.max() <= 1e-5 * want.abs().max(), msg
    bound = x.norm(dim=-1, keepdim=True) * w.norm(dim=1).max() * 2.0**-7  # [12, 1, 1]
    tail = (got - want).abs()
    assert bool((tail <= bound).all()), f"a tail logit moved past its bound: max {tail.max():.3g}"
    assert tail.max() > 0, "the tail was not read in bfloat16: the test tests nothing"


def test_too_many_near_tokens_run_the_whole_head(monkeypatch):
    model = _Head(40_000, 48)
    x = _states(3, 48, 2)
    monkeypatch.setattr(sh, "_MAX_EXACT", 10)
    with torch.no_grad(), sh.shortlist_head(model):
        got = model.lm_head(x)
    want = F.linear(x, model.lm_head.weight).detach()
    assert torch.equal(got, want), diff_msg("whole-head logits", got, want)


@pytest.mark.parametrize(
    "model",
    [
        _Head(1_000, 16),  # a small vocabulary: the head is cheap
        _Head(40_000, 16, bias=True),
        _Head(40_000, 16, dtype=torch.bfloat16),
    ],
    ids=["small-vocab", "bias", "bf16"],
)
def test_other_heads_left_alone(model):
    with sh.shortlist_head(model) as changed:
        assert not changed and "forward" not in vars(model.lm_head)


def test_nested_blocks_keep_the_outer_head():
    model = _Head(40_000, 48)
    head = model.lm_head
    with sh.shortlist_head(model) as outer:
        forward = vars(head)["forward"]
        with sh.shortlist_head(model) as inner:
            assert outer and not inner
        assert vars(head).get("forward") is forward, "the inner block undid the outer's head"
    assert "forward" not in vars(head)


@pytest.mark.tiny
def test_greedy_answers_pick_what_the_float32_head_picks(monkeypatch):
    """Self-study's greedy answers (compiler/bake/selfstudy.py) read the bfloat16 head and
    pick the float32 head's tokens, on a tiny Gemma 3 with a 40,000-token vocabulary."""
    import contextlib

    from ctxc.bake import selfstudy
    from testbed.tiny_models import build

    model = build("gemma3")
    model.resize_token_embeddings(40_000, mean_resizing=False)
    with torch.no_grad():  # spread the logits over ~30 like a real head's
        model.get_input_embeddings().weight.normal_(0.0, 2.0)
    context, rows = list(range(3, 20)), [[21, 22, 23], [24, 25, 26, 27], [30]]
    calls = []
    spy = sh.shortlisted_logits

    def counted(*args):
        calls.append(1)
        return spy(*args)

    monkeypatch.setattr(sh, "shortlisted_logits", counted)
    got = selfstudy.continue_rows(model, context, rows, 12)
    assert len(calls) >= 11, f"the greedy loop read the bfloat16 head {len(calls)} times"
    monkeypatch.setattr(selfstudy, "shortlist_head", lambda _m: contextlib.nullcontext())
    want = selfstudy.continue_rows(model, context, rows, 12)
    assert got == want, f"greedy picks moved: {got} against {want}"


def test_sample_head_is_checked():
    from ctxc.core.errors import OptionError
    from ctxc.core.options import BakeOptions

    assert BakeOptions().sample_head == "float32"
    with pytest.raises(OptionError, match="sample head"):
        BakeOptions(sample_head="float16")
