"""Chat-format fit data for ``ctxc bake --chat`` (issue 35).

A chat model is asked through its chat template. Here the context is the conversation's
context turns (a system prompt, a document as a user turn, earlier turns) and every fit query
is a user turn after them, rendered by the template and split from the context exactly as
``ctxc compile --chat`` splits it (:func:`~ctxc.core.chat.split_chat`): the full input is
``context_ids + turn(q)``, token for token the template's ids for the whole conversation. The
patched model is fed ``opening + turn(q)``, where ``opening`` is what the template itself puts
before that turn when there is no context (SmolLM2's default system turn, Llama 3's and Gemma
3's BOS and turn header, nothing for Qwen 3): ``opening + turn(q)`` is the template's ids for
the one-turn conversation ``[user: q]``, so the baked model is used as any chat model is, its
template applied to the user's message alone. Only the opening's last position is matched to
the context's last (both predict the turn's first token); its others are run, never fitted or
compared (:class:`~ctxc.bake.data.FitData` ``opening``).

The fit queries carry the full-context model's greedy answer as the assistant turn, cut after
the template's end-of-turn token. Self-study in chat (Cartridges, arXiv 2506.06266: seed
prompts as user turns): the model fed the context and a user turn asking for a question about
the text writes one, its reply started with a wh-word (greedy; measured on
SmolLM2-135M-Instruct, sampling at temperature 1 wrote questions off the text, "How many
times have you wondered if a local butcher could be part of a movie"), then answers it with
the context in view.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ctxc.bake.selfstudy import SEED_PROMPTS, context_run, continue_rows
from ctxc.core.chat import (
    ChatSplit,
    check_messages,
    images_in,
    split_chat,
    template_ids,
)
from ctxc.core.errors import CtxcError

__all__ = ["CHAT_SEEDS", "ChatFormat", "answered", "chat_format", "chat_self_study"]

# The user turns that ask the model for a question about the context (Cartridges' seed
# prompts, reduced to the question kind); crossed with the wh-words that start its reply.
CHAT_SEEDS = (
    "Write a short question whose answer is in the text above.",
    "Ask one question about a fact in the text above.",
    "Write a question that a reader of the text above could ask.",
)
_PROBES = ("What is it about?", "Who wrote it?")
_ANSWER_PROBE = "Xq"


@dataclass(frozen=True)
class ChatFormat:
    """How a chat model's fit queries are rendered after a conversation's context turns.

    Attributes:
        tokenizer: the model's tokenizer (its chat template).
        turns: the context turns.
        context_ids: the template's ids for them (a query-independent prefix of every
            conversation that continues them with a user turn).
        opening: what the template puts before a user turn when there is no context: the
            patched model is fed ``opening + turn(q)``.
        opening_exact: ``opening + turn(q)`` is the template's ids for ``[user: q]`` (checked
            on two probes); False: the template renders a lone turn otherwise, and ``opening``
            is the tokenizer's own prefix (its BOS).
        ends: the ids that end an assistant turn (the tokenizer's EOS, the template's turn end).
        split: the split of the first probe (its kind: at the turn or inside it).
    """

    tokenizer: Any = field(repr=False, compare=False)
    turns: tuple[dict, ...]
    context_ids: list[int]
    opening: list[int]
    opening_exact: bool
    ends: frozenset[int]
    split: ChatSplit = field(repr=False)

    def turn(self, text: str) -> list[int]:
        """The ids of the user turn ``text`` with the generation prompt, as the template splits
        it from the context (:func:`~ctxc.core.chat.split_chat`).

        Raises:
            CtxcError: an empty text, or a template whose context changes with the query.
        """
        if not text.strip():
            raise CtxcError("a chat query is empty")
        split = split_chat(self.tokenizer, self.turns, text.strip())
        if split.context_ids != self.context_ids:
            raise CtxcError(
                f"the chat template renders the context differently before the query {text!r}"
            )
        return list(split.query_ids)

    def answer(self, ids: Sequence[int]) -> list[int]:
        """``ids`` up to and with the first end-of-turn id (all of them when none)."""
        ids = [int(i) for i in ids]
        for n, i in enumerate(ids):
            if i in self.ends:
                return ids[: n + 1]
        return ids

    def to_dict(self) -> dict:
        """The report's ``chat`` entry."""
        decode = getattr(self.tokenizer, "decode", None)
        text = decode(self.opening, skip_special_tokens=False) if decode else None
        return {
            "opening_ids": list(self.opening),
            "opening_text": text,
            "opening_is_the_template_s": self.opening_exact,
            "context_turns": len(self.turns),
            "roles": [m["role"] for m in self.turns],
            "messages": [dict(m) for m in self.turns],
            "split": self.split.split,
            "split_why": self.split.why or None,
            "document_and_query_in_one_turn": self.split.merged,
            "end_of_turn_ids": sorted(self.ends),
        }


def chat_format(tokenizer, turns: Sequence[dict]) -> ChatFormat:
    """The :class:`ChatFormat` of the context ``turns`` under ``tokenizer``'s chat template.

    Raises:
        CtxcError: no chat template, bad turns, image parts (bake takes text), or a template
            that cannot be split after these turns (:func:`~ctxc.core.chat.split_chat`).
    """
    turns = check_messages(list(turns), "the chat context")
    if images_in(turns):
        raise CtxcError("bake takes a text conversation: the chat context holds image parts")
    splits = [split_chat(tokenizer, turns, p) for p in _PROBES]
    if splits[0].context_ids != splits[1].context_ids:
        raise CtxcError("the chat template renders the context differently for each query")
    opening, exact = _opening(tokenizer, splits)
    return ChatFormat(
        tokenizer,
        tuple(turns),
        list(splits[0].context_ids),
        opening,
        exact,
        _ends(tokenizer),
        splits[0],
    )


def _opening(tokenizer, splits: list[ChatSplit]) -> tuple[list[int], bool]:
    """(the template's ids before a lone user turn, True), the same for both probes; else
    (the tokenizer's own prefix, False)."""
    found: set[tuple[int, ...]] = set()
    for probe, split in zip(_PROBES, splits, strict=True):
        alone = template_ids(tokenizer, [{"role": "user", "content": probe}])
        k = len(split.query_ids)
        if len(alone) < k or alone[len(alone) - k :] != list(split.query_ids):
            found = set()
            break
        found.add(tuple(alone[: len(alone) - k]))
    if len(found) == 1:
        return list(found.pop()), True
    from ctxc.bake.data import special_prefix

    return special_prefix(tokenizer), False


def _ends(tokenizer) -> frozenset[int]:
    """The tokenizer's EOS and the first token the template writes after an assistant
    message's content (Gemma 3's ``<end_of_turn>``, ChatML's ``<|im_end|>``), when special."""
    ends = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ends.add(eos)
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "A"}, {"role": "assistant", "content": _ANSWER_PROBE}],
            tokenize=False,
        )
    except Exception:  # a template that refuses the exchange: the EOS alone
        return frozenset(ends)
    if isinstance(text, str) and _ANSWER_PROBE in text:
        after = text[text.rindex(_ANSWER_PROBE) + len(_ANSWER_PROBE) :]
        ids = list(tokenizer(after, add_special_tokens=False).input_ids)
        if ids and ids[0] in set(getattr(tokenizer, "all_special_ids", ())):
            ends.add(int(ids[0]))
    return frozenset(ends)


def answered(
    model: torch.nn.Module,
    chat: ChatFormat,
    turns: list[list[int]],
    answer_tokens: int,
    start=None,
) -> list[list[int]]:
    """Each user turn followed by the full-context model's greedy answer (``answer_tokens``,
    cut after its end of turn), in one batch on one context run."""
    if not turns:
        return []
    got = continue_rows(model, chat.context_ids, turns, answer_tokens, start=start)
    return [t + chat.answer(a) for t, a in zip(turns, got, strict=True)]


def _question(chat: ChatFormat, wh: str, ids: list[int]) -> str:
    """The wh-word and the reply up to its first ``?`` (kept); empty when the reply ends its
    turn, or breaks its line, before any ``?``."""
    specials = set(getattr(chat.tokenizer, "all_special_ids", ())) | chat.ends
    cut = next((n for n, i in enumerate(ids) if i in specials), len(ids))
    text = wh + chat.tokenizer.decode(ids[:cut], skip_special_tokens=True)
    end, line = text.find("?"), text.find("\n")
    if end < 0 or 0 <= line < end:
        return ""
    return " ".join(text[: end + 1].split())


def _finished(chat: ChatFormat, ids: list[int]) -> bool:
    """Whether a reply holds what :func:`_question` reads up to (a ``?``, a newline or a special
    token)."""
    specials = set(getattr(chat.tokenizer, "all_special_ids", ())) | chat.ends
    if any(i in specials for i in ids):
        return True
    text = chat.tokenizer.decode(ids, skip_special_tokens=True)
    return "?" in text or "\n" in text


def chat_self_study(
    model: torch.nn.Module,
    chat: ChatFormat,
    count: int,
    question_tokens: int = 24,
    answer_tokens: int = 16,
    seed: int = 0,
    start=None,
) -> tuple[list[list[int]], list[str]]:
    """``count`` self-study queries in chat: a question the model writes about the context and
    its greedy answer, as a user turn and the assistant's.

    The model fed the context and a seed prompt (:data:`CHAT_SEEDS`) as a user turn replies
    from a wh-word (:data:`~ctxc.bake.selfstudy.SEED_PROMPTS`); every (seed prompt, wh-word)
    pair is drawn greedily once, in the order that cycles both; past them, replies are sampled
    (temperature 1, seeded). A reply without a ``?`` before its line or turn ends, or a
    question already drawn, is replaced once by the next pairs, then dropped.

    Returns:
        (the queries' ids, each question's turn followed by its answer; the questions).
    """
    start = start if start is not None else context_run(model, chat.context_ids)
    gen = torch.Generator().manual_seed(seed)
    grid = len(CHAT_SEEDS) * len(SEED_PROMPTS)
    ids = functools.partial(_ids, chat.tokenizer)
    questions: list[str] = []
    drawn = 0
    for _ in range(2):  # a second draw for the replies that are no (new) question
        need = count - len(questions)
        if need <= 0:
            break
        cells = list(range(drawn, drawn + need))
        drawn += need
        rows = [
            chat.turn(CHAT_SEEDS[c % len(CHAT_SEEDS)]) + ids(SEED_PROMPTS[c % len(SEED_PROMPTS)])
            for c in cells
        ]
        until = functools.partial(_finished, chat)
        replies: list = [None] * len(cells)
        for greedy in (True, False):
            idx = [j for j, c in enumerate(cells) if (c < grid) == greedy]
            if idx:
                got = continue_rows(
                    model,
                    chat.context_ids,
                    [rows[j] for j in idx],
                    question_tokens,
                    None if greedy else gen,
                    start,
                    until,
                )
                for j, g in zip(idx, got, strict=True):
                    replies[j] = g
        for c, reply in zip(cells, replies, strict=True):
            q = _question(chat, SEED_PROMPTS[c % len(SEED_PROMPTS)], reply)
            if q and q not in questions and len(questions) < count:
                questions.append(q)
    if not questions:
        return [], []
    queries = answered(model, chat, [chat.turn(q) for q in questions], answer_tokens, start)
    return queries, questions


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)
