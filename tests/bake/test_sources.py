"""The fit data as a list of sources (issue 52): one loop joins the registered sources' rows,
for plain text and chat alike; a new source is its module and a line in the registry."""

from __future__ import annotations

import inspect
import string

import pytest

import ctxc.bake.driver as driver
from ctxc.bake.chat import chat_format
from ctxc.bake.data import text_queries
from ctxc.bake.driver import BakeOptions, bake, bake_data, fit_data
from ctxc.bake.selfstudy import as_question
from ctxc.bake.sources import (
    SOURCES,
    ChatContext,
    FitContext,
    Plan,
    Rows,
    Source,
    TextContext,
    asked_kinds,
    fit_context,
    gather,
    loop,
    registry,
)
from ctxc.core.errors import CtxcError
from testbed.chat import DOCUMENTS, SYSTEMS, chat_tokenizer, shared_chat_model
from testbed.tiny_models import shared
from tests.fixtures.helpers import CharTokenizer

_CHARS = string.ascii_letters + string.digits + " ?.,:'\n"
_TEXT = "Rollo led 12 Norse raiders to Normandy in 911."
_OFF_TOPIC = "What is the capital of France?"


class _Trial(Source):
    """A trial source, shaped as the issue's off-topic rows would be: an unrelated question,
    answered by the full-context model; it records the contexts it was asked with."""

    kind = "trial"
    label = "trial rows"
    asks = True

    def __init__(self) -> None:
        self.seen: list[FitContext] = []

    def plan(self, ctx: FitContext) -> Plan:
        asked = ctx.ask([ctx.question(_OFF_TOPIC)])
        longest = max(len(q) for q in asked) + ctx.options.answer_tokens
        return Plan(len(asked), longest, runs=True, draft=Rows(asked))

    def rows(self, ctx: FitContext, plan: Plan) -> Rows:
        self.seen.append(ctx)
        asked = super().rows(ctx, plan).queries
        return Rows(ctx.answered(asked), [len(q) for q in asked])


class _Fixed(Source):
    kind = "fixed"
    label = "fixed rows"

    def plan(self, ctx: FitContext) -> Plan:
        return Plan(2, 9, draft=Rows([[5, 6], [7]], [1, 0], [[8], []]))


def test_the_registry_lists_the_sources_in_order() -> None:
    assert [s.kind for s in SOURCES] == [
        "file", "self-study", "cloze", "sample", "off-topic-text", "off-topic-question",
        "off-topic-reading",
    ]  # fmt: skip
    # the on-policy refit asks these again
    assert asked_kinds() == (
        "file", "self-study", "cloze", "off-topic-question", "off-topic-reading"
    )  # fmt: skip


def test_bake_data_takes_its_defaults_from_the_options() -> None:
    """One place for a default (the cloze teacher had drifted: ``plain`` against ``shown``)."""
    defaults = BakeOptions()
    params = inspect.signature(bake_data).parameters
    for name in ("answer_tokens", "question_prompt", "question_temperature", "cloze_form",
                 "cloze_teacher"):  # fmt: skip
        assert params[name].default == getattr(defaults, name), name


def test_one_loop_joins_the_sources_rows_and_plans_before_any_run() -> None:
    """No model: the file lines, the cloze queries and a fixed source, in order, with their
    kinds, answer starts and shown rows; the stage line counts each; too long is refused
    before any source makes rows."""
    tok = CharTokenizer(_CHARS)
    opts = BakeOptions(samples=0, questions=0, cloze=2)
    ctx = fit_context(object(), tok, tok(_TEXT).input_ids, opts, ["ab", "c"])
    assert isinstance(ctx, TextContext) and ctx.prefix == [1]
    stages: list[str] = []
    data = gather(ctx, stages.append, (*SOURCES, _Fixed()))
    n = data.kinds.count("cloze")
    assert data.kinds == ["file"] * 2 + ["cloze"] * n + ["fixed"] * 2, data.kinds
    assert stages == [f"fit data: 2 queries, {n} cloze queries, 2 fixed rows"], stages
    assert data.queries[:2] == text_queries(tok, ["ab", "c"]) and data.queries[-2:] == [[5, 6], [7]]
    assert data.answer_from is not None and data.answer_from[-2:] == [1, 0]
    assert data.answer_from[:2] == [0, 0] and all(a > 0 for a in data.answer_from[2 : 2 + n])
    assert data.shown is not None and data.shown[-2:] == [[8], []]  # cloze teacher: shown
    assert data.shown[2 : 2 + n] == data.queries[2 : 2 + n] and data.shown[:2] == [[], []]

    class Long:
        config = type("Config", (), {"max_position_embeddings": 16})()

    ctx = fit_context(Long(), tok, tok(_TEXT[:10]).input_ids, opts)
    with pytest.raises(CtxcError, match="context \\+ longest query is 20 tokens"):
        gather(ctx, sources=(_Fixed(), _Fixed()))


@pytest.mark.tiny
def test_a_registered_source_is_in_plain_and_chat_fit_data(monkeypatch) -> None:
    """A source added to the registry gives rows of its kind in a plain bake and in a chat
    bake, both through the one loop; it asks the context for the format's question and answer
    (text ids after the BOS, or a user turn), and the context runs once for it and the
    samples."""
    trial = _Trial()
    monkeypatch.setattr(registry, "SOURCES", (*SOURCES, trial))
    assert "trial" in asked_kinds()
    loops: list[type] = []
    runs: list[int] = []

    def spied_gather(ctx, *args, **kwargs):
        loops.append(type(ctx))
        return gather(ctx, *args, **kwargs)

    real_run = loop.context_run

    def counted_run(model, ids):
        runs.append(len(ids))
        return real_run(model, ids)

    monkeypatch.setattr(loop, "context_run", counted_run)
    monkeypatch.setattr(driver, "gather", spied_gather)

    tok = CharTokenizer(_CHARS)
    context = tok(_TEXT).input_ids
    opts = BakeOptions(samples=2, sample_tokens=3, questions=0, cloze=0, rank=2, answer_tokens=4)
    plain = bake(shared("gemma3"), tok, context_ids=context, options=opts).data
    asked = text_queries(tok, [as_question(_OFF_TOPIC)])[0]
    assert plain.kinds == ["sample"] * 2 + ["trial"], plain.kinds
    assert plain.queries[-1][: len(asked)] == asked and len(plain.queries[-1]) > len(asked)
    assert plain.answer_from is not None and plain.answer_from[-1] == len(asked)

    model, chat_tok = shared_chat_model("llama3"), chat_tokenizer("llama3")
    turns = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": DOCUMENTS[0]}]
    chat_opts = BakeOptions(samples=2, sample_tokens=4, questions=0, cloze=0, answer_tokens=5,
                            rank=4, on_policy=False)  # fmt: skip
    result = bake(model, chat_tok, options=chat_opts, messages=turns)
    turn = chat_format(chat_tok, turns).turn(_OFF_TOPIC)
    assert result.data.kinds == ["sample"] * 2 + ["trial"], result.data.kinds
    assert result.data.queries[-1][: len(turn)] == turn and result.data.opening
    assert result.report["fit_kinds"] == {"sample": 2, "trial": 1}

    assert loops == [TextContext, ChatContext]  # one loop, two contexts
    assert [type(c) for c in trial.seen] == [TextContext, ChatContext]
    assert all(c.start is not None for c in trial.seen)  # shared with the samples
    assert runs == [len(context), len(result.data.context_ids)]  # once per bake


@pytest.mark.tiny
def test_the_stage_line_counts_every_source() -> None:
    """``fit data:`` names each source's count, the cloze queries too (issue 52)."""
    tok = CharTokenizer(_CHARS)
    context = tok(_TEXT).input_ids
    opts = BakeOptions(samples=2, sample_tokens=3, questions=2, cloze=3, cloze_teacher="plain")
    stages: list[str] = []
    data = fit_data(shared("gemma3"), tok, context, ["ab"], opts, stages.append)
    n = data.kinds.count("cloze")
    assert stages == [
        f"fit data: 1 queries, 2 self-study questions, {n} cloze queries, 2 samples"
    ], stages


@pytest.mark.tiny
def test_off_topic_rows_are_sampled_without_the_context_and_change_no_other_row() -> None:
    """``off_topic`` (issue 53): rows of their own kind after the others, sampled from the BOS
    alone (the same rows whatever the context), seeded apart from the fit's samples; the other
    rows are the bake's without them, bit for bit."""
    from testbed.tiny_models import build, tiny_tokenizer

    model, tok = build("gemma3"), tiny_tokenizer()
    base = BakeOptions(samples=2, sample_tokens=4, questions=0, cloze=0, rank=4)
    with_rows = BakeOptions(**{**vars(base), "off_topic": 3, "off_topic_tokens": 5})
    got = {}
    for text in ("w1 w2 w3 w4 w5 w6", "w40 w41 w42"):
        ids = list(tok(text).input_ids)
        plain = fit_data(model, tok, ids, None, base, lambda _: None)
        more = fit_data(model, tok, ids, None, with_rows, lambda _: None)
        assert more.kinds == ["sample", "sample"] + ["off-topic-text"] * 3, more.kinds
        assert more.queries[:2] == plain.queries, "the off-topic rows changed the others"
        assert all(len(q) == 5 for q in more.queries[2:]), more.queries
        assert more.queries[2:] != plain.queries, "drawn with the fit samples' seed"
        got[text] = more.queries[2:]
    assert got["w1 w2 w3 w4 w5 w6"] == got["w40 w41 w42"], "the off-topic rows saw the context"
    with pytest.raises(CtxcError, match="off_topic must be at least 0"):
        BakeOptions(off_topic=-1)


@pytest.mark.tiny
def test_off_topic_readings_read_a_text_the_context_never_saw_then_ask_about_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``off_topic_reading`` (issue 53): each row is a text sampled from the BOS alone, then a
    question the model writes reading that text alone (a tiny random model writes none, so the
    writer is replaced by one that records what it was fed), then the full-context model's
    answer; the rows up to the answer are the same whatever the context."""
    import ctxc.bake.sources.offtopic as offtopic
    from testbed.tiny_models import build, tiny_tokenizer

    model, tok = build("gemma3"), tiny_tokenizer()
    fed: list[list[int]] = []

    def write(_model, _tok, start, count, **_kw):
        fed.append(list(start))
        return [], ["Who w7"] * count

    monkeypatch.setattr(offtopic, "self_study", write)
    options = BakeOptions(
        samples=1,
        sample_tokens=2,
        questions=0,
        cloze=0,
        rank=4,
        off_topic_reading=3,
        off_topic_tokens=6,
    )
    bos = list(tok("w1").input_ids)[:1]
    got = {}
    for text in ("w1 w2 w3 w4 w5 w6", "w40 w41 w42"):
        fed.clear()
        data = fit_data(model, tok, list(tok(text).input_ids), None, options, lambda _: None)
        assert data.kinds == ["sample"] + ["off-topic-reading"] * 3, data.kinds
        assert len(fed) == 3 and all(f[:1] == bos and len(f) == 7 for f in fed), fed
        asked = [q[:a] for q, a in zip(data.queries[1:], data.answer_from[1:], strict=True)]
        for f, q in zip(fed, asked, strict=True):
            read = tok.decode(f[1:], skip_special_tokens=True)
            assert q == text_queries(tok, [read + as_question("Who w7")])[0], (read, q)
        got[text] = asked
    assert got["w1 w2 w3 w4 w5 w6"] == got["w40 w41 w42"], "the texts saw the context"
    with pytest.raises(CtxcError, match="off_topic_tokens must be at least 1"):
        BakeOptions(off_topic_tokens=0)
