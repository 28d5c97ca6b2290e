"""Off-topic rows: text and questions the model writes without the context, fitted to the model
reading the context (issue 53).

The other sources are all about the context, so nothing holds the patch to what the model does
elsewhere: baked, a paragraph's model answered 30 of 144 general questions where the model
reading the paragraph answered 53. These rows are drawn from the model fed its BOS alone (no
context: ordinary text, general questions), and their targets, like every row's, are the
full-context model's on ``context + row``: fitted, the patched model is asked to do off the
context what the model reading the context does. A question is answered by the full-context
model (:meth:`FitContext.answered`), in the bake's own format (plain text or chat turns).
Seeded apart from the fit's samples (``seed``) and the held-out samples (``seed + 1``).
"""

from __future__ import annotations

from ctxc.bake.data import sample_continuations, special_prefix
from ctxc.bake.selfstudy import self_study
from ctxc.bake.sources.base import Plan, Rows, Source
from ctxc.bake.sources.context import FitContext
from ctxc.core.errors import OptionError
from ctxc.core.vocabulary import (
    OFF_TOPIC_QUESTION_KIND,
    OFF_TOPIC_READING_KIND,
    OFF_TOPIC_TEXT_KIND,
)

__all__ = ["OffTopicQuestions", "OffTopicReading", "OffTopicText"]

_TEXT_SEED, _QUESTION_SEED, _READING_SEED = 2, 3, 4  # added to the bake's seed


def _start(ctx: FitContext, what: str) -> list[int]:
    """What the model is fed to write without the context: its tokenizer's BOS.

    Raises:
        OptionError: a tokenizer that puts nothing before a text (nothing to start from).
    """
    ids = special_prefix(ctx.tokenizer)
    if not ids:
        raise OptionError("{" + what + "} samples from the BOS: this tokenizer puts none")
    return ids


class OffTopicText(Source):
    """``off_topic`` continuations of ``off_topic_tokens`` sampled from the BOS alone."""

    kind = OFF_TOPIC_TEXT_KIND
    label = "off-topic samples"

    def plan(self, ctx: FitContext) -> Plan:
        n = ctx.options.off_topic
        return Plan(n, ctx.options.off_topic_tokens if n else 0)

    def rows(self, ctx: FitContext, plan: Plan) -> Rows:
        o = ctx.options
        bos = _start(ctx, "off_topic")
        return Rows(
            sample_continuations(
                ctx.model, bos, plan.count, o.off_topic_tokens, o.seed + _TEXT_SEED
            )
        )


class OffTopicReading(Source):
    """``off_topic_reading`` rows that read another text: ``off_topic_tokens`` sampled from the
    BOS alone, then a question the model writes about that text (reading it, without the
    context), answered by the full-context model (which reads the context, then the text).

    What a user does who bakes a document and then puts another one in the prompt: the patched
    model is held to read the other text as the model reading the context does.
    """

    kind = OFF_TOPIC_READING_KIND
    label = "off-topic readings"
    asks = True

    def plan(self, ctx: FitContext) -> Plan:
        n = ctx.options.off_topic_reading
        bound = ctx.options.off_topic_tokens + ctx.longest_question() + ctx.options.answer_tokens
        return Plan(n, bound if n else 0, runs=n > 0)

    def rows(self, ctx: FitContext, plan: Plan) -> Rows:
        o = ctx.options
        bos = _start(ctx, "off_topic_reading")
        seed = o.seed + _READING_SEED
        texts = sample_continuations(ctx.model, bos, plan.count, o.off_topic_tokens, seed)
        asked: list[list[int]] = []
        for k, ids in enumerate(texts):
            # One question per text, written by the model reading that text alone.
            _, questions = self_study(
                ctx.model,
                ctx.tokenizer,
                bos + ids,
                1,
                answer_tokens=1,
                seed=seed + k,
                temperature=o.question_temperature,
            )
            if questions:
                text = ctx.tokenizer.decode(ids, skip_special_tokens=True)
                asked.append(ctx.reading(text, questions[0]))
        return Rows(ctx.answered(asked), [len(q) for q in asked])


class OffTopicQuestions(Source):
    """``off_topic_questions`` questions the model writes from the BOS alone (as self-study
    writes them, with no context before ``Question:``), each answered by the full-context
    model in the bake's format."""

    kind = OFF_TOPIC_QUESTION_KIND
    label = "off-topic questions"
    asks = True

    def plan(self, ctx: FitContext) -> Plan:
        n = ctx.options.off_topic_questions
        return Plan(n, ctx.longest_question() + ctx.options.answer_tokens if n else 0, runs=n > 0)

    def rows(self, ctx: FitContext, plan: Plan) -> Rows:
        o = ctx.options
        bos = _start(ctx, "off_topic_questions")
        # The questions only: written and (one token) answered without the context.
        _, texts = self_study(
            ctx.model,
            ctx.tokenizer,
            bos,
            plan.count,
            answer_tokens=1,
            seed=o.seed + _QUESTION_SEED,
            temperature=o.question_temperature,
        )
        asked = ctx.ask([ctx.question(q) for q in texts])
        return Rows(ctx.answered(asked), [len(q) for q in asked])
