"""On-policy fit rows (``ctxc.bake.onpolicy``, issue 35): the first fit's patched model answers
each fitted question, the full-context model reads those answers, and the fit is solved again
over both. Tiny random chat models carrying real templates; plain text on a tiny Gemma 3."""

from __future__ import annotations

import string

import pytest
import torch

from ctxc.bake.driver import BakeOptions, bake
from ctxc.bake.onpolicy import ON_POLICY_KIND, asked_queries, joined_targets
from ctxc.bake.selfstudy import answer_end, continue_rows
from ctxc.bake.targets import cached_fit_targets
from ctxc.core.errors import OptionError
from ctxc.store.traced import traced_blocks
from testbed.chat import DOCUMENTS, QUERIES, SYSTEMS, chat_tokenizer, shared_chat_model
from testbed.tiny_models import VOCAB, shared
from tests.fixtures.helpers import CharTokenizer

pytestmark = pytest.mark.tiny

_TURNS = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": DOCUMENTS[0]}]
_CHAT = BakeOptions(samples=2, sample_tokens=4, questions=0, cloze=2, answer_tokens=5, rank=4)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.float() - b.float()).abs()
    return f"max {float(d.max()):.3g}, mean {float(d.mean()):.3g}"


def test_a_chat_bake_refits_on_its_own_answers_by_default() -> None:
    """One on-policy query per question query (the three answered turns, the cloze ones): its
    question's ids, then the first fit's patched model's greedy answer to it, cut after the end
    of its turn. The first fit is the bake with ``on_policy=False`` (same data, same fit), so
    its patch gives those answers again here; the refit's patch differs from it."""
    model, tok = shared_chat_model("llama3"), chat_tokenizer("llama3")
    with_rows = bake(model, tok, None, list(QUERIES), options=_CHAT, messages=_TURNS)
    plain = BakeOptions(**{**_CHAT.__dict__, "on_policy": False})
    first = bake(model, tok, None, list(QUERIES), options=plain, messages=_TURNS)
    data, chat = with_rows.data, with_rows.chat
    assert chat is not None and data.answer_from is not None
    n = len(first.data.queries)
    asked = asked_queries(first.data)
    cloze = first.data.kinds.count("cloze")
    assert cloze >= 1 and len(asked) == 3 + cloze, first.data.kinds
    assert data.kinds == first.data.kinds + [ON_POLICY_KIND] * len(asked), data.kinds
    assert data.queries[:n] == first.data.queries
    assert with_rows.report["fit_kinds"][ON_POLICY_KIND] == len(asked)
    for k, i in enumerate(asked):
        question = first.data.queries[i][: first.data.answer_from[i]]
        got = data.queries[n + k]
        assert got[: len(question)] == question and data.answer_from[n + k] == len(question)
        answer = got[len(question) :]
        assert 1 <= len(answer) <= 5 and not any(t in chat.ends for t in answer[:-1]), answer
        with torch.no_grad(), first.patch.applied(model):
            direct = continue_rows(model, data.prefix, [question], len(answer))[0]
        assert [int(t) for t in direct] == answer, (k, direct, answer)
    assert data.shown is not None  # read as its question's row was (a cloze one: shown)
    assert [data.shown_before(n + k) for k in range(len(asked))] == [
        first.data.shown_before(i) for i in asked
    ]
    assert any(data.shown_before(n + k) for k in range(len(asked)))
    moved = [
        _max_rel(with_rows.patch.deltas[p].materialize(model.get_parameter(p)), d.materialize(
            model.get_parameter(p)))
        for p, d in first.patch.deltas.items()
    ]  # fmt: skip
    assert any(not m.startswith("max 0 ") for m in moved), moved


def test_plain_text_bakes_without_them_unless_asked() -> None:
    """Plain text: no on-policy rows by default (measured in chat only); ``on_policy=True``
    adds one per cloze query, its answer cut after a line break as the teacher's are."""
    chars = string.ascii_letters + string.digits + " ?.,:'\n"
    model, tok = shared("gemma3"), CharTokenizer(chars, special=(0, 1, 2, 3))
    assert 4 + len(chars) <= VOCAB
    text = "The lighthouse on Skerry Point was built in 1874 by Alan Stevenson."
    opts = BakeOptions(samples=2, sample_tokens=4, questions=0, cloze=2, answer_tokens=4, rank=4,
                       cloze_teacher="plain")  # fmt: skip
    off = bake(model, tok, text, options=opts)
    assert ON_POLICY_KIND not in off.data.kinds and "on_policy" not in off.report["timings"]
    on = bake(model, tok, text, options=BakeOptions(**{**opts.__dict__, "on_policy": True}))
    asked = asked_queries(off.data)
    assert asked and on.data.kinds.count(ON_POLICY_KIND) == len(asked), on.data.kinds
    for q in on.data.queries[len(off.data.queries) :]:
        answer = q[on.data.answer_from[on.data.queries.index(q)] :]
        assert answer_end(tok, answer) == len(answer), tok.decode(answer)


def test_joined_targets_are_the_whole_set_s() -> None:
    """The first rows' targets joined with the new rows' equal the targets of all the queries
    at once (the cached context run; batches change the summation order only)."""
    model, tok = shared_chat_model("gemma3"), chat_tokenizer("gemma3")
    data = bake(model, tok, None, list(QUERIES), options=_CHAT, messages=_TURNS).data
    n = data.kinds.index(ON_POLICY_KIND)
    traced, blocks = traced_blocks(model)
    whole = cached_fit_targets(model, traced, blocks, data)
    parts = joined_targets(
        cached_fit_targets(model, traced, blocks, data.part(0, n)),
        cached_fit_targets(model, traced, blocks, data.part(n)),
    )
    assert parts.keys() == whole.keys()
    for path, t in whole.items():
        assert parts[path].y.shape == t.y.shape == (data.positions, t.y.shape[1]), path
        for name in ("z", "y"):
            got, want = getattr(parts[path], name), getattr(t, name)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=_max_rel(got, want))


def test_twice_gives_the_same_patch_and_distill_refuses_it() -> None:
    model, tok = shared_chat_model("qwen3"), chat_tokenizer("qwen3")
    a, b = (bake(model, tok, None, list(QUERIES), options=_CHAT, messages=_TURNS) for _ in "ab")
    assert a.data.queries == b.data.queries
    for p, d in a.patch.deltas.items():
        assert torch.equal(d.materialize(model.get_parameter(p)), b.patch.deltas[p].materialize(
            model.get_parameter(p))), p  # fmt: skip
    with pytest.raises(OptionError, match="refits the fit: it needs"):
        BakeOptions(method="distill", on_policy=True)


def test_the_new_rows_refit_is_a_refit_pass_over_the_answers_on_top_of_the_first_fit() -> None:
    """``on_policy_refit="new"``: the same on-policy rows as the default, but the second fit is
    a refit pass of :func:`fit_solve` over their answers alone, started from the first fit's
    deltas (its patch differs from the first fit's and from the whole refit's, rank kept)."""
    from ctxc.bake.driver import query_rows

    model, tok = shared_chat_model("llama3"), chat_tokenizer("llama3")
    new = BakeOptions(**{**_CHAT.__dict__, "on_policy_refit": "new"})
    first_o = BakeOptions(**{**_CHAT.__dict__, "on_policy": False})
    got = bake(model, tok, None, list(QUERIES), options=new, messages=_TURNS)
    whole = bake(model, tok, None, list(QUERIES), options=_CHAT, messages=_TURNS)
    first = bake(model, tok, None, list(QUERIES), options=first_o, messages=_TURNS)
    assert got.data.queries == whole.data.queries and got.data.kinds == whole.data.kinds
    n = len(first.data.queries)
    part = got.data.part(n)
    assert first.fit is not None and got.fit is not None
    rows = query_rows(part, answers=True)  # the answers (and the position before each)
    assert 0 < int(rows.sum()) < part.positions, (int(rows.sum()), part.positions)
    want = _solved(model, part, new, rows, first.fit.deltas)
    for p, d in got.patch.deltas.items():
        w = model.get_parameter(p)
        mine = d.materialize(w)
        assert torch.equal(mine, want.deltas[p].materialize(w)), p
        assert not torch.equal(mine, first.patch.deltas[p].materialize(w)), p
        assert not torch.equal(mine, whole.patch.deltas[p].materialize(w)), p
        assert d.rank is None or d.rank <= 4, (p, d.rank)
    with pytest.raises(OptionError, match="on-policy refit"):
        BakeOptions(on_policy_refit="some")


def test_the_answers_refit_fits_every_row_but_the_new_rows_questions() -> None:
    """``on_policy_refit="answers"``: the second fit over every row (the default's data and
    targets) with the on-policy rows' question positions run, not fitted."""
    from ctxc.bake.driver import query_rows

    model, tok = shared_chat_model("llama3"), chat_tokenizer("llama3")
    opts = BakeOptions(**{**_CHAT.__dict__, "on_policy_refit": "answers"})
    got = bake(model, tok, None, list(QUERIES), options=opts, messages=_TURNS)
    whole = bake(model, tok, None, list(QUERIES), options=_CHAT, messages=_TURNS)
    assert got.data.queries == whole.data.queries
    data, n = got.data, got.data.kinds.index(ON_POLICY_KIND)
    rows = torch.cat([query_rows(data.part(0, n)), query_rows(data.part(n), answers=True)])
    assert int(rows.sum()) < int(query_rows(data).sum()), "no question position left out"
    want = _solved(model, data, opts, rows)
    for p, d in got.patch.deltas.items():
        w = model.get_parameter(p)
        mine = d.materialize(w)
        torch.testing.assert_close(mine, want.deltas[p].materialize(w), msg=p)
        assert not torch.equal(mine, whole.patch.deltas[p].materialize(w)), p


def _solved(model, data, opts: BakeOptions, rows: torch.Tensor, start=None):
    """:func:`fit_solve` called directly on ``data``'s rows ``rows`` (from ``start``)."""
    from ctxc.bake.driver import fit_options
    from ctxc.passes.solver.fit_solve import fit_solve

    traced, blocks = traced_blocks(model)
    targets = cached_fit_targets(model, traced, blocks, data)
    queries = [torch.tensor([data.reduced(i)]) for i in range(len(data.queries))]
    return fit_solve(traced, blocks, targets, queries, fit_options(opts), rows=rows, start=start)
