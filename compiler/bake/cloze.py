"""Extractive self-study: questions whose answer is a span of the context itself (issue 35).

The model's own self-study questions ask about what its questions share (the text's subject),
and their answers are whatever the model writes: a patch fitted on them carries recognition of
the context, not recall of its facts. Here every fact the text states as a name, a number or a
date (and every sentence's last words after a preposition: "such as time and storage") becomes
one fit query: the sentence holding the span, the span replaced by a wh-word
chosen from its kind, is the question (``"The Normans gave their name to Normandy in the 10th
century."`` -> ``"The Normans gave their name to Normandy in when?"``; a span that opens its
sentence -> ``"Who gave their name to Normandy in the 10th century?"``), asked the way a
held-out question is fed (:func:`~ctxc.bake.selfstudy.as_question`), and its answer is the span
itself followed by a line break. No model is needed to write them; the fit's targets are the
full-context model's, teacher-forced on the span (``BakeOptions.cloze``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ctxc.bake.data import text_queries
from ctxc.bake.selfstudy import NOT_TOPICS
from ctxc.core.vocabulary import CLOZE_PHRASINGS, CLOZE_TURN_PHRASINGS

__all__ = ["Cloze", "chat_cloze_queries", "cloze_queries", "clozes"]

# Names: capitalised runs joined by of/de/and/the ("King Charles III of West Francia"), as
# :func:`~ctxc.bake.selfstudy.topics` finds them.
_NAME = re.compile(r"\b[A-Z][\w'’-]*(?:\s+(?:(?:of|de|and|the)\s+)?[A-Z][\w'’-]*)*")
# Numbers: digits (an ordinal, a decade, "1.3bn", "70%") or a count in words, with a scale word
# after it ("12 million", "60 percent", "10th century"); the counted noun stays in the question
# ("how many metropolitan areas").
_COUNT_WORDS = "one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|twenty|hundreds"
_SCALE = r"million|billion|thousand|hundred|percent|per cent|centuries|century"
_NUMBER = re.compile(
    rf"(?<![\w.])(?:\d[\d,.]*(?:st|nd|rd|th|s|bn|m|%)?|(?:{_COUNT_WORDS})\b)"
    rf"(?:\s+(?:{_SCALE})\b)?"
)
# A sentence's last words after a preposition or a copula ("such as time and storage", "the
# practical limits on what computers can and cannot do"): the span of a sentence without names
# or numbers too.
_TAIL_AFTER = re.compile(
    r"\b(?:such as|in|of|to|from|with|by|for|as|on|at|over|than|into|is|are|was|were)\s+"
)
_TAIL_WORDS = 6
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_PARENTHESES = re.compile(r"\s*\([^()]*\)")
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_WHEN = re.compile(rf"^(?:1\d{{3}}|20\d{{2}})s?$|centur|\b(?:{_MONTHS})\b")
_WHO_BEFORE = frozenset(("leader", "king", "queen", "by", "president", "emperor", "named"))
_STOP = frozenset(("of", "de", "and", "the"))
# Words kept around a span: before it, back to its clause's start (or this many words); after
# it, to its clause's end (or this many).
_LEFT_WORDS = 24
_RIGHT_WORDS = 10
_CLAUSE_WORDS = 4


@dataclass(frozen=True)
class Cloze:
    """One extractive question.

    Attributes:
        question: the question's text (ends in ``?``).
        answer: the span of the context that answers it.
        sentence: the sentence of the context it was made from.
    """

    question: str
    answer: str
    sentence: str


def _spans(sentence: str, names: frozenset[str]) -> list[tuple[int, int]]:
    """(start, end) of the names and numbers in ``sentence``, in order, none overlapping an
    earlier one: a name loses its leading sentence furniture ("The"), a trailing joining word
    and a possessive; a single-word name opening the sentence is kept only when ``names``
    holds it (it is capitalised elsewhere too: "Victoria", not "Through")."""
    found: list[tuple[int, int]] = []
    for match in (*_NUMBER.finditer(sentence), *_NAME.finditer(sentence)):
        words = [(w.start(), w.end()) for w in re.finditer(r"\S+", match.group(0))]
        text = match.group(0)
        while words and text[words[0][0] : words[0][1]] in NOT_TOPICS:
            words = words[1:]
        while words and text[words[-1][0] : words[-1][1]].strip(",.;:") in _STOP:
            words = words[:-1]
        if not words:
            continue
        start, end = match.start() + words[0][0], match.start() + words[-1][1]
        end -= len(sentence[start:end]) - len(sentence[start:end].rstrip(",.;:"))
        if re.search(r"['’]s$", sentence[start:end]):
            end -= 2
        span = sentence[start:end]
        if start == 0 and " " not in span and span not in names:
            continue  # a capitalised opening word, not a name
        if end > start and all(s >= end or e <= start for s, e in found):
            found.append((start, end))
    tail = _tail(sentence)
    if tail is not None and all(s >= tail[1] or e <= tail[0] for s, e in found):
        found.append(tail)
    return sorted(found)


def _tail(sentence: str) -> tuple[int, int] | None:
    """(start, end) of the sentence's last words after its last preposition or copula, when
    they are 1 to ``_TAIL_WORDS`` words within one clause; else None."""
    body = sentence.rstrip(" .!?\"'")
    for match in reversed(list(_TAIL_AFTER.finditer(body))):
        rest = body[match.end() :]
        if re.search(r"[,;:]", rest) or len(rest.split()) > _TAIL_WORDS:
            return None
        if rest.split():
            return match.end(), len(body)
    return None


def _wh(span: str, before: str) -> str:
    """The wh-word asking for ``span`` (``before``: the sentence up to it)."""
    if _WHEN.search(span):
        return "when"
    if "percent" in span or span.endswith("%"):
        return "what percentage"
    if re.match(r"\d+(?:st|nd|rd|th)$", span):
        return "which"
    if _NUMBER.fullmatch(span):
        return "how much" if span.endswith(("bn", "m")) else "how many"
    last = before.split()[-1].lower().strip(",") if before.split() else ""
    return "who" if last in _WHO_BEFORE else "what"


def _clause_right(text: str) -> str:
    """The words after a span up to its clause's end (at most ``_RIGHT_WORDS``)."""
    cut = re.split(r"[,;:!?]|\.(?!\d)", text, maxsplit=1)[0]
    return " ".join(cut.split()[:_RIGHT_WORDS])


def _question(sentence: str, start: int, end: int, form: str = "sentence") -> str:
    """``sentence`` asking for its span ``[start:end]``: the span replaced by its wh-word (the
    sentence's opening words dropped before a span that opens it), cut to its clause after it;
    before it, to the sentence's start (``sentence``: at most ``_LEFT_WORDS`` words) or to its
    clause's start (``clause``: back to the last comma, at least ``_CLAUSE_WORDS`` words)."""
    before, span, after = sentence[:start], sentence[start:end], sentence[end:]
    wh = _wh(span, before)
    head = before.strip()
    if not head or head in NOT_TOPICS:  # the span is the subject: "Who gave ...?"
        rest = after.strip().rstrip(".!?")
        if form == "clause":
            rest = _clause_right(rest)
        if rest.startswith(("'s ", "’s ")):  # "Southern California's population ..."
            wh, rest = "whose", rest[3:]
        return f"{wh[0].upper()}{wh[1:]} {rest}?" if rest else ""
    left = re.split(r"[;:]", head)[-1].split()[-_LEFT_WORDS:]
    if form == "clause":
        clause = re.split(r",", " ".join(left))[-1].split()
        left = clause if len(clause) >= _CLAUSE_WORDS else left[-_CLAUSE_WORDS:]
    right = _clause_right(after)
    text = " ".join([*left, wh, *right.split()]).strip(" ,")
    return text[0].upper() + text[1:] + "?"


def clozes(text: str, form: str = "sentence") -> list[Cloze]:
    """Every extractive question of ``text``, in the text's order: one per name, number or
    count of each sentence (parentheses dropped; two with ``form`` ``both``, the sentence's
    then the clause's when they differ), the question's text without its answer."""
    out: list[Cloze] = []
    sentences = [" ".join(s.split()) for s in _SENTENCE_END.split(_PARENTHESES.sub("", text))]
    # Words capitalised past a sentence's opening: names wherever they stand.
    names = frozenset(m.group(0) for s in sentences for m in re.finditer(r"(?<=\S )[A-Z]\w*", s))
    for sentence in sentences:
        for start, end in _spans(sentence, names):
            span = sentence[start:end]
            forms = ("sentence", "clause") if form == "both" else (form,)
            asked = dict.fromkeys(_question(sentence, start, end, f) for f in forms)
            for q in asked:
                if q and span.lower() not in q.lower():
                    out.append(Cloze(q, span, sentence))
    return out


def _spaced(text: str, count: int, form: str) -> list[Cloze]:
    """``count`` of :func:`clozes` (all of them when fewer; evenly spaced over the text)."""
    every = clozes(text, form)
    if count < len(every):
        every = [every[i * len(every) // count] for i in range(count)]
    return every


def _worded(question: str, index: int, phrasings: int, wordings: tuple[str, ...]) -> str:
    """Cloze question ``index`` in its wording: round-robin over the first ``phrasings``."""
    return wordings[index % phrasings].format(question=question.strip())


def chat_cloze_queries(
    chat, count: int, form: str = "sentence", phrasings: int = 1
) -> tuple[list[list[int]], list[int], list[Cloze]]:
    """:func:`cloze_queries` of a chat model's context turns: each question the user's turn
    (``chat.turn``, after the context turns, as a held-out chat question is fed), its answer the
    span and the template's end of turn (the tokenizer's EOS where it ends a turn).

    Args:
        chat: the :class:`~ctxc.bake.chat.ChatFormat` (its context turns' text is read).
        phrasings: the turn's wordings, round-robin (:data:`CLOZE_TURN_PHRASINGS`' first).

    Returns:
        (the queries' ids; where each answer starts; the :class:`Cloze` of each).
    """
    tokenizer = chat.tokenizer
    text = "\n\n".join(m["content"] for m in chat.turns if isinstance(m.get("content"), str))
    eos = getattr(tokenizer, "eos_token_id", None)
    end = eos if eos in chat.ends else min(chat.ends, default=None)
    ids, starts, every = [], [], _spaced(text, count, form)
    for i, c in enumerate(every):
        asked = chat.turn(_worded(c.question, i, phrasings, CLOZE_TURN_PHRASINGS))
        span = list(tokenizer(c.answer, add_special_tokens=False).input_ids)
        ids.append(asked + span + ([end] if end is not None else []))
        starts.append(len(asked))
    return ids, starts, every


def cloze_queries(
    tokenizer, text: str, count: int, form: str = "sentence", phrasings: int = 1
) -> tuple[list[list[int]], list[int], list[Cloze]]:
    """``count`` fit queries of :func:`clozes` (all of them when fewer; evenly spaced over the
    text when more): the question as a held-out question is fed (question ``i`` in wording
    ``i % phrasings`` of :data:`CLOZE_PHRASINGS`, the first ctxc's own), then the span and a
    line break.

    Returns:
        (the queries' ids; where each answer starts; the :class:`Cloze` of each).
    """
    every = _spaced(text, count, form)
    ids, starts = [], []
    for i, c in enumerate(every):
        asked = text_queries(tokenizer, [_worded(c.question, i, phrasings, CLOZE_PHRASINGS)])[0]
        answer = list(tokenizer(" " + c.answer + "\n", add_special_tokens=False).input_ids)
        ids.append(asked + answer)
        starts.append(len(asked))
    return ids, starts, every
