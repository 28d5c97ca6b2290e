"""Extractive self-study (issue 35): questions whose answer is a span of the context; the
questions without a model, the fit data on a tiny random model."""

from __future__ import annotations

import string

import pytest
import torch

from ctxc.bake.cloze import cloze_queries, clozes
from ctxc.bake.driver import BakeOptions, bake, bake_data, query_rows
from ctxc.bake.selfstudy import QUESTION_FORMAT, as_question
from ctxc.core.errors import OptionError
from ctxc.core.vocabulary import CLOZE_PHRASINGS, CLOZE_TURN_PHRASINGS
from testbed.tiny_models import VOCAB, shared
from tests.fixtures.helpers import CharTokenizer, diff_msg

_TEXT = (
    "The Normans were the people who in the 10th and 11th centuries gave their name to "
    "Normandy, a region in France. They were descended from Norse raiders from Denmark who, "
    "under their leader Rollo, swore fealty to King Charles III of West Francia. Through "
    "generations of mixing, their descendants merged with the local cultures. Southern "
    "California's population encompasses seven metropolitan areas, with over 12 million "
    "inhabitants in Los Angeles (the largest city). It holds 60 percent of the state's people."
)

_CHARS = string.ascii_letters + string.digits + " ?.,:'\n"


def test_every_answer_is_a_span_of_its_sentence_and_the_question_asks_for_it() -> None:
    got = clozes(_TEXT)
    asked = {c.answer: c.question for c in got}
    assert asked["Normans"].startswith("What were the people who in the 10th"), asked
    assert asked["Normandy"].endswith("gave their name to what?"), asked
    assert asked["Rollo"].endswith("under their leader who?"), asked
    assert asked["11th centuries"].startswith("The Normans were the people who in the 10th and "
                                              "when gave"), asked  # fmt: skip
    assert asked["seven"].endswith("encompasses how many metropolitan areas?"), asked
    assert asked["12 million"].endswith("with over how many inhabitants in Los Angeles?"), asked
    assert asked["60 percent"] == "It holds what percentage of the state's people?", asked
    # A sentence's last words after a preposition: the span of a sentence without names.
    want = "Through generations of mixing, their descendants merged with what?"
    assert asked["the local cultures"] == want, asked
    assert "King Charles III of West Francia" in asked and "West Francia" not in asked
    # A capitalised word opening a sentence is not a name unless it is one elsewhere; nothing
    # inside parentheses is asked ("the largest city").
    assert "Through" not in asked and "They" not in asked, asked
    assert not any("largest city" in c.question for c in got), got
    plain = _TEXT.replace(" (the largest city)", "")
    for c in got:
        assert c.answer in c.sentence and c.sentence in plain and c.answer in _TEXT, c
        assert c.question.endswith("?") and c.answer.lower() not in c.question.lower(), c


def test_cloze_queries_are_the_question_as_fed_then_the_span_and_a_line_break() -> None:
    tok = CharTokenizer(_CHARS, special=(0, 1, 2, 3))
    every = clozes(_TEXT)
    ids, starts, picked = cloze_queries(tok, _TEXT, 1000)
    assert picked == every and len(ids) == len(starts) == len(every)
    for q, a, c in zip(ids, starts, picked, strict=True):
        asked = tok(" " + as_question(c.question), add_special_tokens=False).input_ids
        assert q[:a] == asked
        assert tok.decode(q[a:]) == " " + c.answer + "\n"
        assert c.answer in _TEXT
    # Fewer than there are: evenly spaced over the text, in its order.
    _, _, three = cloze_queries(tok, _TEXT, 3)
    assert three == [every[i * len(every) // 3] for i in range(3)]


def test_cloze_phrasings_word_the_questions_round_robin_and_one_is_ctxcs_own() -> None:
    tok = CharTokenizer(_CHARS, special=(0, 1, 2, 3))
    # The first wording is the one a held-out question is fed in: 1 phrasing is the old rows.
    assert CLOZE_PHRASINGS[0] == QUESTION_FORMAT and CLOZE_TURN_PHRASINGS[0] == "{question}"
    assert cloze_queries(tok, _TEXT, 8, phrasings=1) == cloze_queries(tok, _TEXT, 8)
    n = len(CLOZE_PHRASINGS)
    ids, starts, picked = cloze_queries(tok, _TEXT, 2 * n, phrasings=n)
    assert len(ids) == 2 * n, len(ids)
    for i, (q, a, c) in enumerate(zip(ids, starts, picked, strict=True)):
        worded = CLOZE_PHRASINGS[i % n].format(question=c.question)
        assert tok.decode(q[:a]) == " " + worded, (i, tok.decode(q[:a]))
        assert tok.decode(q[a:]) == " " + c.answer + "\n"  # the answer as before
    assert len(set(CLOZE_PHRASINGS)) == n == len(CLOZE_TURN_PHRASINGS), CLOZE_PHRASINGS
    for bad in (0, n + 1):
        with pytest.raises(OptionError, match="cloze_phrasings"):
            BakeOptions(cloze_phrasings=bad)


def test_clause_form_cuts_the_question_to_the_spans_clause_and_both_asks_both() -> None:
    clause = {c.answer: c.question for c in clozes(_TEXT, "clause")}
    assert clause["France"] == "Normandy, a region in what?", clause
    assert clause["the local cultures"] == "Their descendants merged with what?", clause
    both = clozes(_TEXT, "both")
    france = [c.question for c in both if c.answer == "France"]
    sentence = {c.answer: c.question for c in clozes(_TEXT)}
    assert france == [sentence["France"], clause["France"]], france
    # A span whose two forms are the same question is asked once.
    assert len(both) < 2 * len(clozes(_TEXT))
    assert [c.question for c in both if c.answer == "seven"] == [sentence["seven"]]


@pytest.mark.tiny
def test_bake_fits_the_cloze_queries_answers_only() -> None:
    """``cloze`` adds the extractive queries after the self-study ones (kind ``cloze``); with
    ``fit_rows`` ``answers`` only the positions predicting the span and its line break are
    fitted."""
    model, tok = shared("gemma3"), CharTokenizer(_CHARS, special=(0, 1, 2, 3))
    assert 4 + len(_CHARS) <= VOCAB
    text = _TEXT[:118]  # the first sentence
    context = tok(text).input_ids
    # The plain teacher: the shown one reads each query twice, past the tiny model's positions.
    data = bake_data(model, tok, context, None, 2, 3, 0, cloze=4, cloze_teacher="plain")
    assert data.kinds == ["cloze"] * 4 + ["sample"] * 2, data.kinds
    ids, starts, _ = cloze_queries(tok, text, 4)
    assert data.queries[:4] == ids and data.answer_from is not None
    assert data.answer_from[:4] == starts
    rows = query_rows(data, answers=True)
    fitted = int(rows.sum())
    assert fitted == sum(len(q) - a + 1 for q, a in zip(ids, starts, strict=True)) + 2 * 3
    opts = BakeOptions(data="self-study", questions=0, samples=0, cloze=4, rank=2,
                       fit_rows="answers", cloze_teacher="plain")  # fmt: skip
    result = bake(model, tok, context_ids=context, options=opts)
    assert result.report["fit_kinds"] == {"cloze": 4}, result.report["fit_kinds"]


def test_cloze_is_a_count_and_counts_as_fit_data() -> None:
    with pytest.raises(OptionError, match="cloze must be at least 0"):
        BakeOptions(cloze=-1)
    with pytest.raises(OptionError, match="cloze must be an integer"):
        BakeOptions(cloze="8")  # type: ignore[arg-type]
    BakeOptions(data="self-study", questions=0, cloze=8).check_fit(None)
    with pytest.raises(OptionError, match="questions 0 and cloze 0 and no queries"):
        BakeOptions(data="self-study", questions=0, cloze=0).check_fit(None)
    assert BakeOptions(data="continuations", cloze=8).clozed == 0
    with pytest.raises(OptionError, match="cloze_form: unknown cloze form 'short'"):
        BakeOptions(cloze=8, cloze_form="short")


@pytest.mark.tiny
def test_shown_teacher_reads_each_cloze_query_before_itself() -> None:
    """``cloze_teacher`` ``shown``: the full-context model reads each cloze query (question and
    span) once before it, the other queries as before; the matched positions are the full
    input's last, the cached targets equal the graph's there, and they differ from the plain
    teacher's on the cloze rows alone (the shown text reaches the targets)."""
    from ctxc.bake.data import record_fit_targets
    from ctxc.bake.evaluate import greedy, reference
    from ctxc.bake.targets import cached_fit_targets
    from ctxc.store.traced import traced_blocks

    model, tok = shared("gemma3"), CharTokenizer(_CHARS, special=(0, 1, 2, 3))
    text = "Rollo led 12 Norse raiders."  # short: each cloze query is read twice (256 positions)
    context = tok(text).input_ids
    plain = bake_data(model, tok, context, None, 2, 3, 0, cloze=3, cloze_teacher="plain")
    shown = bake_data(model, tok, context, None, 2, 3, 0, cloze=3)  # the default teacher
    assert plain.shown is None and shown.queries == plain.queries, shown.kinds
    n = shown.kinds.count("cloze")  # Rollo, 12 (a sentence of two spans)
    assert n == 2 and shown.kinds == ["cloze"] * n + ["sample"] * 2, shown.kinds
    for i, q in enumerate(shown.queries):
        before = q if shown.kinds[i] == "cloze" else []
        assert shown.full(i) == context + before + q, i
        assert shown.reduced(i) == plain.reduced(i) and shown.matched(i) == plain.matched(i)
    traced, blocks = traced_blocks(model)
    graph = record_fit_targets(traced, blocks, shown)
    cached = cached_fit_targets(model, traced, blocks, shown)
    before = record_fit_targets(traced, blocks, plain)
    rows = [len(shown.reduced(i)) for i in range(len(shown.queries))]
    cloze_rows = sum(rows[:n])
    for path, tg in graph.items():
        got = cached[path]
        assert got.y.shape == tg.y.shape == before[path].y.shape, path
        torch.testing.assert_close(got.y, tg.y, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got.z, tg.z, rtol=1e-4, atol=1e-5)
        moved = (tg.y - before[path].y).abs().amax(dim=1)  # [N]
        assert torch.equal(tg.y[cloze_rows:], before[path].y[cloze_rows:]), diff_msg(
            path, tg.y[cloze_rows:], before[path].y[cloze_rows:]
        )
    assert float(moved[:cloze_rows].max()) > 1e-3, float(moved[:cloze_rows].max())
    # The evaluation's (and distill's) teacher: the same positions of the same full inputs.
    ref = reference(model, shown, gen_tokens=2)
    with torch.no_grad():
        for i in range(len(shown.queries)):
            k = shown.matched(i)
            want = model(input_ids=torch.tensor([shown.full(i)])).logits[0, -k:]
            got = ref.logits[i]
            assert got.shape == want.shape, (i, got.shape, want.shape)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert list(ref.tokens[i]) == greedy(model, shown.full(i), 2), i


def test_cloze_teacher_is_a_choice_and_not_for_distill() -> None:
    with pytest.raises(OptionError, match="cloze_teacher: unknown cloze teacher 'copy'"):
        BakeOptions(cloze_teacher="copy")
    assert BakeOptions().cloze_teacher == "shown"
