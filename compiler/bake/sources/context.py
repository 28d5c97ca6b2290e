"""What every fit-data source reads: the model, the context, the options and the format.

A bake is plain text or chat. The sources do not branch on it: they ask the context, and the
two contexts answer as their format does (:class:`TextContext`: the tokenizer's ids after a
BOS; :class:`ChatContext`: user turns after a conversation's context turns, ``ctxc.bake.chat``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ctxc.bake.chat import CHAT_SEEDS, ChatFormat, answered, chat_self_study
from ctxc.bake.cloze import chat_cloze_queries, cloze_queries
from ctxc.bake.data import special_prefix, text_queries
from ctxc.bake.selfstudy import answer_end, as_question, continue_rows, self_study
from ctxc.core.options import BakeOptions

__all__ = ["ChatContext", "FitContext", "TextContext", "fit_context"]

# The longest plain self-study question: "Question: ...?\nAnswer:" (<= ~40 tokens).
_TEXT_QUESTION = 48
# A chat self-study reply: a wh-word and 24 tokens (then its question's turn: the template's
# tokens and at most ~26 of the question's).
_CHAT_REPLY = 32


@dataclass(frozen=True, kw_only=True)
class FitContext:
    """What the sources share.

    Attributes:
        model: the unpatched causal LM.
        tokenizer: its tokenizer (None: samples only).
        context_ids: the context's ids (a chat bake's: its context turns').
        options: the :class:`~ctxc.core.options.BakeOptions` (the counts: ``asked``,
            ``sampled``, ``clozed``, ``topical``; tokens, seed, prompts, cloze form and
            teacher).
        prefix: what the patched model is fed before each query (``FitData.prefix``).
        queries: the query texts (``--queries``' lines).
        answer: each query text is followed by the full-context model's greedy answer (a
            fit's chat turns); False: as written (held-out queries, plain-text lines).
        start: :func:`~ctxc.bake.selfstudy.context_run` of the context, set when more than
            one source continues it (computed once); None: each computes its own.
    """

    opening: ClassVar[bool] = False  # FitData.opening: the prefix is a template's opening

    model: torch.nn.Module = field(repr=False)
    tokenizer: Any = field(repr=False)
    context_ids: list[int]
    options: BakeOptions
    prefix: list[int]
    queries: tuple[str, ...] = ()
    answer: bool = False
    start: Any = field(default=None, repr=False)

    @property
    def topics(self) -> int:
        """Topic questions the self-study asks besides ``options.asked``."""
        return 0

    def ask(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text as a query is fed after the context (its ids; a user turn in chat)."""
        raise NotImplementedError

    def question(self, text: str) -> str:
        """The query text a question is asked in (``Question: ...\\nAnswer:`` in plain text)."""
        return text

    def reading(self, text: str, question: str) -> list[int]:
        """A query that reads ``text`` and then asks ``question`` about it (its ids)."""
        raise NotImplementedError

    def answered(self, rows: list[list[int]]) -> list[list[int]]:
        """Each row followed by the full-context model's greedy answer (at most
        ``options.answer_tokens``, cut as the format ends an answer), in one batch."""
        raise NotImplementedError

    def longest_question(self) -> int:
        """A bound on a self-study query's length before its answer."""
        raise NotImplementedError

    def self_study(self) -> tuple[list[list[int]], list[str]]:
        """The self-study queries (question and answer) and their questions' texts."""
        raise NotImplementedError

    def cloze(self) -> tuple[list[list[int]], list[int]]:
        """``options.clozed`` extractive queries and where each answer starts."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class TextContext(FitContext):
    """A plain-text bake: a query is the tokenizer's ids of its text after the BOS."""

    @property
    def topics(self) -> int:
        return self.options.topical

    def ask(self, texts: Sequence[str]) -> list[list[int]]:
        return text_queries(self.tokenizer, texts)

    def question(self, text: str) -> str:
        return as_question(text)

    def reading(self, text: str, question: str) -> list[int]:
        return self.ask([text + self.question(question)])[0]

    def answered(self, rows: list[list[int]]) -> list[list[int]]:
        if not rows:
            return []
        ends = functools.partial(answer_end, self.tokenizer)
        got = continue_rows(
            self.model,
            self.context_ids,
            rows,
            self.options.answer_tokens,
            start=self.start,
            until=lambda a: ends(a) < len(a),
        )
        return [r + a[: ends(a)] for r, a in zip(rows, got, strict=True)]

    def longest_question(self) -> int:
        return _TEXT_QUESTION

    def self_study(self) -> tuple[list[list[int]], list[str]]:
        o = self.options
        return self_study(
            self.model,
            self.tokenizer,
            self.context_ids,
            o.asked,
            answer_tokens=o.answer_tokens,
            seed=o.seed,
            start=self.start,
            prompt=o.question_prompt,
            temperature=o.question_temperature,
            topic_count=o.topical,
        )

    def cloze(self) -> tuple[list[list[int]], list[int]]:
        text = self.tokenizer.decode(self.context_ids, skip_special_tokens=True)
        o = self.options
        ids, starts, _ = cloze_queries(
            self.tokenizer, text, o.clozed, o.cloze_form, o.cloze_phrasings
        )
        return ids, starts


@dataclass(frozen=True, kw_only=True)
class ChatContext(FitContext):
    """A chat bake (``ctxc.bake.chat``): a query is a user turn after the context turns, the
    prefix the template's opening; self-study asks in turns and writes no topic questions."""

    opening: ClassVar[bool] = True

    chat: ChatFormat

    def ask(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.chat.turn(t) for t in texts]

    def reading(self, text: str, question: str) -> list[int]:
        # One user turn: the text, then the question about it.
        return self.chat.turn(f"{text.strip()}\n\n{question}")

    def answered(self, rows: list[list[int]]) -> list[list[int]]:
        return answered(self.model, self.chat, rows, self.options.answer_tokens, self.start)

    def longest_question(self) -> int:
        return max(len(self.chat.turn(s)) for s in CHAT_SEEDS) + _CHAT_REPLY

    def self_study(self) -> tuple[list[list[int]], list[str]]:
        o = self.options
        return chat_self_study(
            self.model,
            self.chat,
            o.asked,
            answer_tokens=o.answer_tokens,
            seed=o.seed,
            start=self.start,
        )

    def cloze(self) -> tuple[list[list[int]], list[int]]:
        o = self.options
        ids, starts, _ = chat_cloze_queries(self.chat, o.clozed, o.cloze_form, o.cloze_phrasings)
        return ids, starts


def fit_context(
    model: torch.nn.Module,
    tokenizer,
    context_ids: list[int],
    options: BakeOptions,
    queries: Sequence[str] | None = None,
    chat: ChatFormat | None = None,
    answer: bool = False,
    prefix: list[int] | None = None,
) -> FitContext:
    """The context of a bake's sources.

    Args:
        model, tokenizer, context_ids, options, queries: :class:`FitContext`'s.
        chat: a chat model's :class:`~ctxc.bake.chat.ChatFormat`: its context turns' ids and
            its template's opening replace ``context_ids`` and ``prefix``.
        answer: with ``chat``, each query text's turn is answered (:attr:`FitContext.answer`);
            a plain-text query line is fitted as written.
        prefix: plain text: the ids before each query; None: the tokenizer's
            (:func:`~ctxc.bake.data.special_prefix`, none without a tokenizer).

    Returns:
        a :class:`ChatContext` with ``chat``, else a :class:`TextContext`.
    """
    texts = tuple(queries) if queries else ()
    if chat is not None:
        return ChatContext(
            model=model,
            tokenizer=chat.tokenizer,
            context_ids=list(chat.context_ids),
            options=options,
            prefix=list(chat.opening),
            queries=texts,
            answer=answer,
            chat=chat,
        )
    if prefix is None:
        prefix = special_prefix(tokenizer) if tokenizer is not None else []
    return TextContext(
        model=model,
        tokenizer=tokenizer,
        context_ids=list(context_ids),
        options=options,
        prefix=list(prefix),
        queries=texts,
    )
