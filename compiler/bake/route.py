"""``ctxc.bake.route``: a long document as one patch per chunk, and the chunk each question reads.

One rank-64 patch of a whole article keeps 0.13-0.16 of the F1 the article adds (SQuAD, five
articles of 2.3-2.8k words: docs/results/squad-articles-cloze.md): its cloze rows reach 18 of 100
questions' answers, and with every span in the fit one patch does not keep hundreds of
question-to-span maps apart. A paragraph's own patch keeps 1.08 of its paragraph's
(docs/results/squad-cloze.md). So a routed bake cuts the document at its blank lines into
chunks of whole paragraphs (:func:`split_chunks`), bakes each chunk alone with the same
options, and keeps a lexical router beside the patches: BM25+ (Lv and Zhai, 2011;
``rank_bm25.BM25Plus``) of the question against each chunk's words picks the chunk whose
patch answers it. BM25+, not Okapi BM25: Okapi's idf is zero for a word in half the chunks and
for every word of a two-chunk document (log((N - n + 0.5) / (n + 0.5))), so a short document
would route every question to its first chunk; BM25+'s log((N + 1) / n) stays positive. On the
article benchmark's 100 questions they route to the paragraph holding the answer 85 and 87
times. What the bake already has picks the patch: the chunks' text, no model run.

A chunk is added by baking it alone and adding its text to the router, and removed by
deleting both: no patch already made is touched. Each chunk's patch is an ordinary bake folder
(``chunks/<id>/``, whatever ``--emit`` wrote), so a serving engine that takes one LoRA per
request (vLLM's multi-LoRA) serves the document as one adapter per chunk, picked by
:meth:`Router.pick` (``ctxc route DIR --query TEXT``). A chat model's document is baked as chat
chunks (``ctxc bake --route --chat --system DOC.txt``): each chunk the system turn of its own
chat bake (:func:`chunk_turns`), so each chunk's adapter answers a user turn through the
template.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ctxc.bake.scope import THRESHOLD, Scope, terms, words
from ctxc.core.errors import CtxcError

__all__ = [
    "CHUNKS_DIR",
    "CHUNK_WORDS",
    "ROUTER_FILE",
    "Router",
    "chunk_turns",
    "split_chunks",
    "words",
]

ROUTER_FILE = "router.json"
CHUNKS_DIR = "chunks"  # a routed bake's chunk folders: DIR/chunks/<id>/
# A chunk's words at most when paragraphs are joined: the paragraph benchmark's contexts (SQuAD
# paragraphs, 100-200 words) are what one patch was measured to keep; a longer paragraph stays
# one chunk whole (never cut inside).
CHUNK_WORDS = 200
_FORMAT = "ctxc-router/1"


def split_chunks(text: str, max_words: int = CHUNK_WORDS) -> list[str]:
    """``text`` cut at its blank lines into paragraphs, neighbours joined while the chunk stays
    within ``max_words`` words (``str.split``); a longer paragraph is a chunk alone.

    Args:
        text: the document.
        max_words: the most words of a chunk made of several paragraphs (at least 1).

    Returns:
        the chunks in order, each its paragraphs joined by a blank line.

    Raises:
        CtxcError: a document with no words.
    """
    if max_words < 1:
        raise CtxcError(f"--chunk-words must be at least 1, not {max_words}")
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    if not paragraphs:
        raise CtxcError("the context has no text to cut into chunks")
    chunks: list[list[str]] = []
    size = 0
    for p in paragraphs:
        n = len(p.split())
        if chunks and size + n <= max_words:
            chunks[-1].append(p)
            size += n
        else:
            chunks.append([p])
            size = n
    return ["\n\n".join(c) for c in chunks]


def chunk_turns(chunk: str) -> list[dict]:
    """The context turns of a routed chat bake's ``chunk``: one system turn holding it, as
    ``ctxc bake --chat --system CHUNK.txt`` gives them (a new list each call)."""
    return [{"role": "system", "content": chunk}]


@dataclass(frozen=True)
class Router:
    """The chunks of a routed bake, in order: their ids (folder names under ``chunks/``), their
    texts, and the bake options every chunk was fitted with.

    Attributes:
        ids: one per chunk, unique.
        texts: each chunk's text, as baked.
        options: the :class:`~ctxc.core.options.BakeOptions` fields (JSON), for ``--add``.
        chunk_words: :func:`split_chunks`'s ``max_words`` the document was cut with.
        emit: the ``--emit`` artefacts each chunk's folder holds (a chunk added gets them too).
        chat: each chunk was baked as a chat bake whose system turn it is
            (:func:`chunk_turns`); a chunk added is too.
        scope: the least coverage (:class:`~ctxc.bake.scope.Scope`) of a question by the
            document's words for any chunk to answer it; None (a router written before
            scopes) sends every question to a chunk.
    """

    ids: tuple[str, ...]
    texts: tuple[str, ...]
    options: dict
    chunk_words: int = CHUNK_WORDS
    emit: tuple[str, ...] = ()
    chat: bool = False
    scope: float | None = THRESHOLD

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.texts) or len(set(self.ids)) != len(self.ids):
            raise CtxcError("a router needs one unique id per chunk text")

    def scores(self, question: str) -> list[float]:
        """BM25 score of ``question`` against each chunk (higher: more of its rare words)."""
        from rank_bm25 import BM25Plus

        if not self.ids:
            raise CtxcError("the routed bake holds no chunk")
        index = BM25Plus([words(t) for t in self.texts])
        return [float(s) for s in index.get_scores(words(question))]

    def pick(self, question: str) -> str:
        """The id of the chunk ``question`` reads: the best BM25 score, the first on a tie
        (a question with no word of the document goes to the first chunk)."""
        got = self.scores(question)
        return self.ids[max(range(len(got)), key=lambda i: (got[i], -i))]

    def document_scope(self) -> Scope:
        """The scope of the whole document (every chunk's words) at the router's threshold
        (0 for a router with none: it admits every question)."""
        return Scope(terms("\n\n".join(self.texts)), self.scope or 0.0)

    def route(self, question: str) -> str | None:
        """The id of the chunk ``question`` reads (:meth:`pick`), or None when the document's
        scope does not admit it: the question is served by the unpatched model."""
        if self.scope is not None and not self.document_scope().admits(question):
            return None
        return self.pick(question)

    def added(self, ids: list[str], texts: list[str]) -> Router:
        """This router with chunks appended (a new router; this one unchanged)."""
        return dataclasses.replace(self, ids=(*self.ids, *ids), texts=(*self.texts, *texts))

    def removed(self, chunk: str) -> Router:
        """This router without ``chunk`` (an id); a new router."""
        if chunk not in self.ids:
            raise CtxcError(
                f"no chunk {chunk!r} in this routed bake (it has {', '.join(self.ids)})"
            )
        keep = [i for i, c in enumerate(self.ids) if c != chunk]
        return dataclasses.replace(
            self, ids=tuple(self.ids[i] for i in keep), texts=tuple(self.texts[i] for i in keep)
        )

    def next_ids(self, count: int) -> list[str]:
        """``count`` new chunk ids after the ones held: zero-padded numbers, never reused."""
        taken = [int(i) for i in self.ids if i.isdigit()]
        start = max(taken, default=-1) + 1
        return [f"{n:03d}" for n in range(start, start + count)]

    def text(self) -> str:
        """``router.json``'s text."""
        chunks = [{"id": i, "text": t} for i, t in zip(self.ids, self.texts, strict=True)]
        doc = {
            "format": _FORMAT,
            "options": self.options,
            "chunk_words": self.chunk_words,
            "emit": list(self.emit),
            "chat": self.chat,
            "scope": None if self.scope is None else {"threshold": self.scope},
            "chunks": chunks,
        }
        return json.dumps(doc, indent=1) + "\n"

    def save(self, folder: Path) -> None:
        """Write ``folder/router.json``."""
        (folder / ROUTER_FILE).write_text(self.text(), encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> Router:
        """The router of a routed bake folder; one line when ``folder`` is not one."""
        path = Path(folder) / ROUTER_FILE
        if not path.is_file() and (Path(folder) / CHUNKS_DIR).is_dir():
            raise CtxcError().naming(
                "{} is a routed bake not finished (no {} yet): rerun its bake with the same "
                "options and {resume}",
                folder,
                ROUTER_FILE,
            )
        if not path.is_file():
            raise CtxcError(
                f"{folder} is not a routed bake (no {ROUTER_FILE}): bake it with --route"
            )
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if doc.get("format") != _FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
            chunks = doc["chunks"]
            return cls(
                tuple(c["id"] for c in chunks),
                tuple(c["text"] for c in chunks),
                dict(doc["options"]),
                int(doc["chunk_words"]),
                tuple(doc["emit"]),
                _chat_of(doc),
                _scope_of(doc),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise CtxcError(f"{path} is not a ctxc router ({exc})") from None


def _scope_of(doc: dict) -> float | None:
    """``router.json``'s scope threshold (None in a router written before scopes: it gates
    nothing, as it was baked to).

    Raises:
        ValueError: a scope that is not ``{"threshold": t}``.
    """
    got = doc.get("scope")
    if got is None:
        return None
    if not isinstance(got, dict) or not isinstance(got.get("threshold"), (int, float)):
        raise ValueError(f"scope {got!r}")
    return float(got["threshold"])


def _chat_of(doc: dict) -> bool:
    """``router.json``'s ``chat`` (False in a router written before chat chunks were baked).

    Raises:
        ValueError: a value that is not a boolean.
    """
    chat = doc.get("chat", False)
    if not isinstance(chat, bool):
        raise ValueError(f"chat {chat!r}")
    return chat
