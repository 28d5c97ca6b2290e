"""Self-study fit data and answer agreement (issue 25) on tiny random models: batched
left-padded generation against one row at a time, the questions' shape, the first sentence."""

from __future__ import annotations

import string

import pytest
import torch

from ctxc.bake.driver import BakeOptions, bake, bake_data
from ctxc.bake.evaluate import answer_lengths, evaluate_against, greedy, reference
from ctxc.bake.selfstudy import (
    SEED_PROMPTS,
    TOPIC_QUESTION,
    answer_end,
    as_question,
    continue_rows,
    self_study,
)
from testbed.tiny_models import VOCAB, shared
from tests.fixtures.helpers import CharTokenizer, random_ids

pytestmark = pytest.mark.tiny

_CHARS = string.ascii_letters + " ?.:\n"


@pytest.mark.parametrize(("family", "n"), [("gemma3", 12), ("gemma3", 1), ("llama", 12)])
def test_batched_rows_generate_what_each_row_generates_alone(family: str, n: int) -> None:
    """Rows of three lengths on a shared context cache, left-padded in one batch (or, past
    Gemma's sliding window of 8, batched by length): each row's greedy tokens are those of the
    model fed context + row alone."""
    model = shared(family)
    context = [1, *random_ids(90, n)]
    rows = [random_ids(91, 3), random_ids(92, 5), random_ids(93, 1), random_ids(94, 5)]
    got = continue_rows(model, context, rows, 1 if n == 1 else 5)
    with torch.no_grad():
        want = [greedy(model, context + r, 1 if n == 1 else 5) for r in rows]
    assert got == want, (got, want)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_sampling_stops_once_every_row_is_finished(family: str) -> None:
    """``until``: the draws stop at the step where the last row finishes; every row's tokens
    are the first ones of the full-length draw with the same seed. Past Gemma's sliding window
    of 8 (batches by length) nothing stops: the second batch's draws stay the same."""
    model = shared(family)
    context = [1, *random_ids(96, 6)]
    rows = [random_ids(97, 2), random_ids(98, 3), random_ids(99, 2)]
    full = continue_rows(model, context, rows, 12, torch.Generator().manual_seed(5))
    picked = {toks[3] for toks in full}  # row i is finished once it holds its 4th token
    short = continue_rows(
        model, context, rows, 12, torch.Generator().manual_seed(5),
        until=lambda ids: bool(picked & set(ids)),
    )  # fmt: skip
    stop = max(min(j for j, t in enumerate(toks) if t in picked) for toks in full) + 1
    assert stop < 12, (stop, full)
    want = full if family == "gemma3" else [toks[:stop] for toks in full]
    assert short == want, (short, full)


def test_self_study_queries_are_questions_with_the_greedy_answer() -> None:
    """Each query is ``Question: <seed word>...?`` and the model's greedy answer with the
    context in view; the questions are seeded (the same twice)."""
    assert 4 + len(_CHARS) <= VOCAB, VOCAB
    model, tok = shared("gemma3"), CharTokenizer(_CHARS)
    context = [1, *random_ids(95, 16, vocab=4 + len(_CHARS))]
    queries, questions = self_study(model, tok, context, 12, 30, 4, seed=3)
    assert questions, "no question ended in '?': the test cannot check them"
    assert (queries, questions) == self_study(model, tok, context, 12, 30, 4, seed=3)
    for q, text in zip(queries, questions, strict=True):
        assert text.endswith("?") and any(text.startswith(s) for s in SEED_PROMPTS), text
        asked = tok(" " + as_question(text), add_special_tokens=False).input_ids
        assert q[: len(asked)] == asked, (q, asked)
        with torch.no_grad():
            answer = greedy(model, context + asked, 4)
        # the answer ends after its first line break (kept), else it is all 4 tokens
        newline = tok("\n", add_special_tokens=False).input_ids[0]
        end = answer.index(newline) + 1 if newline in answer else 4
        assert q[len(asked) :] == answer[:end], (q[len(asked) :], answer)


def test_bake_on_self_study_data_marks_its_queries() -> None:
    model, tok = shared("gemma3"), CharTokenizer(_CHARS)
    context = [1, *random_ids(95, 16, vocab=4 + len(_CHARS))]
    opts = BakeOptions(data="both", samples=2, sample_tokens=3, questions=6, rank=2)
    result = bake(model, tok, context_ids=context, options=opts)
    kinds = result.report["fit_kinds"]
    assert kinds["sample"] == 2 and 1 <= kinds["self-study"] <= 6, kinds


def test_answer_agreement_is_the_first_sentence_matched() -> None:
    """The first sentence ends at the first '.', '?', '!' or newline; a query agrees when the
    patched model's greedy tokens match through it (here the unpatched control's)."""
    tok = CharTokenizer(_CHARS)
    ids = tok("ab. cd", add_special_tokens=False).input_ids
    assert answer_lengths(tok, (tuple(ids), tuple(ids[:2]))) == (3, 2)
    model = shared("gemma3")
    context = [1, *random_ids(96, 10, vocab=4 + len(_CHARS))]
    data = bake_data(model, tok, context, ["Question: who is it?\nAnswer:"], 0, 1, 0)
    ref = reference(model, data, 6, tokenizer=tok)
    assert ref.answer_len is not None and 1 <= ref.answer_len[0] <= 6
    unpatched = evaluate_against(model, None, ref)
    assert unpatched.answers in (0.0, 1.0)
    assert unpatched.answers == float(unpatched.matched_all[0] >= ref.answer_len[0])


def test_sampled_tokens_follow_the_softmax_and_never_a_masked_token() -> None:
    """The inverse-CDF sampler: frequencies within 4 standard errors of the softmax over 40k
    draws, a token at -inf never drawn, the same draws for the same seed."""
    from ctxc.bake.data import sample_tokens

    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, float("-inf")]).expand(40_000, -1)
    picks = sample_tokens(logits, torch.Generator().manual_seed(2))
    freq = torch.bincount(picks, minlength=5).double() / picks.numel()
    want = logits[0].double().softmax(-1)
    err = 4 * (want * (1 - want) / picks.numel()).sqrt()
    assert bool(((freq - want).abs() <= err).all()), (freq.tolist(), want.tolist())
    assert int(freq[4]) == 0
    again = sample_tokens(logits, torch.Generator().manual_seed(2))
    assert torch.equal(picks, again)


def test_answers_end_at_their_first_line_break() -> None:
    """A self-study answer is cut after its first token holding a line break or a special
    token; what follows ("\nAnswer: ...", "<eos>The ...") is not fitted."""
    tok = CharTokenizer(_CHARS)
    ids = tok("ab\ncd", add_special_tokens=False).input_ids
    assert answer_end(tok, ids) == 3
    assert answer_end(tok, ids[:2]) == 2

    assert answer_end(CharTokenizer(_CHARS, special=(1,)), [*ids[:2], 1, *ids[3:]]) == 3


def test_facts_prompt_and_topic_questions_join_the_sampled_ones() -> None:
    """``prompt="facts"`` asks for the questions after its line (the same seed draws other
    questions than ``plain``); ``topic_count`` adds "What does the text say about X?" for the
    context's first names, after the sampled questions, each with its greedy answer."""
    model, tok = shared("gemma3"), CharTokenizer(_CHARS)
    context = [1, *tok("Rollo led the Norse in Normandy", add_special_tokens=False).input_ids]
    plain = self_study(model, tok, context, 6, 30, 3, seed=3)
    facts = self_study(model, tok, context, 6, 30, 3, seed=3, prompt="facts", temperature=0.6)
    assert plain != facts
    _, asked = self_study(model, tok, context, 6, 30, 3, seed=3, topic_count=2)
    assert asked[-2:] == [TOPIC_QUESTION.format(topic=t) for t in ("Rollo", "Norse")], asked
