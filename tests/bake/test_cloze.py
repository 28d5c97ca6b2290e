"""Extractive self-study (issue 35): questions whose answer is a span of the context; the
questions without a model, the fit data on a tiny random model."""

from __future__ import annotations

import string

import pytest

from ctxc.bake.cloze import cloze_queries, clozes
from ctxc.bake.driver import BakeOptions, bake, bake_data, query_rows
from ctxc.bake.selfstudy import as_question
from ctxc.core.errors import OptionError
from testbed.tiny_models import VOCAB, shared
from tests.fixtures.helpers import CharTokenizer

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
    data = bake_data(model, tok, context, None, 2, 3, 0, cloze=4)
    assert data.kinds == ["cloze"] * 4 + ["sample"] * 2, data.kinds
    ids, starts, _ = cloze_queries(tok, text, 4)
    assert data.queries[:4] == ids and data.answer_from is not None
    assert data.answer_from[:4] == starts
    rows = query_rows(data, answers=True)
    fitted = int(rows.sum())
    assert fitted == sum(len(q) - a + 1 for q, a in zip(ids, starts, strict=True)) + 2 * 3
    opts = BakeOptions(data="self-study", questions=0, samples=0, cloze=4, rank=2,
                       fit_rows="answers")  # fmt: skip
    result = bake(model, tok, context_ids=context, options=opts)
    assert result.report["fit_kinds"] == {"cloze": 4}, result.report["fit_kinds"]


def test_cloze_is_a_count_and_counts_as_fit_data() -> None:
    with pytest.raises(OptionError, match="cloze must be at least 0"):
        BakeOptions(cloze=-1)
    with pytest.raises(OptionError, match="cloze must be an integer"):
        BakeOptions(cloze="8")  # type: ignore[arg-type]
    BakeOptions(data="self-study", questions=0, cloze=8).check_fit(None)
    with pytest.raises(OptionError, match="topics 0 and cloze 0 and no queries"):
        BakeOptions(data="self-study", questions=0, cloze=0).check_fit(None)
    assert BakeOptions(data="continuations", cloze=8).clozed == 0
    with pytest.raises(OptionError, match="cloze_form: unknown cloze form 'short'"):
        BakeOptions(cloze=8, cloze_form="short")
