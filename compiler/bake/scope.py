"""``ctxc.bake.scope``: which queries a baked patch answers, and which it leaves to the model.

A baked patch is a change of weights: it acts on every input, not only on questions about its
context. Fitted to do what the model reading the context does, it pulls unrelated answers
towards the context (issue 53: a paragraph's bake answers 180 of the general questions the
model reading the paragraph answers 304 times, and reads another paragraph at F1 24.0 where the
original reads it at 41.1). No setting of the fit measured keeps the paragraph's reading and
does no harm off it (docs/bake.md, "No harm off the context"): the rows that hold the patch
to the model elsewhere take the paragraph's own questions with them, since they are questions
too. So, as knowledge editors do with a scope classifier (SERAC, Mitchell et al. 2022; GRACE,
Hartvigsen et al. 2023, with a deferral radius), the patch is applied to the queries its
context is about and the others are served by the unpatched model. A serving engine that picks
an adapter per request (vLLM's multi-LoRA, PEFT's ``set_adapter``, llama.cpp's per-request
LoRA scale) applies it there; ``ctxc route DIR --query TEXT`` answers the question for a bake
folder or a routed bake.

The gate is lexical, like the router (:mod:`ctxc.bake.route`): no model runs. A query's
*coverage* is the share of its words' information that the context holds: each distinct word
``w`` (lower-cased ``\\w+`` runs) weighs ``max(0, cB(w) - COMMON_CB) / 100``, where ``cB(w)``
is how rare ``w`` is in English, in centibels below one (wordfreq's ``small_en`` list: a word
of frequency ``f`` has ``cB = -100 log10 f``; a word not on the list counts as
:data:`UNLISTED_CB`). The ~300 words more frequent than 10^-2.5 ("the", "what", "is", "of")
weigh nothing, so a question's form and function words decide nothing; names, numbers and
rare words decide. A query is in scope when its coverage is at least the threshold.

The two numbers were chosen on SQuAD v2.0 dev paragraphs outside ``benchmarks/data/squad/
subset.json`` (150 paragraphs of 100-200 words from 34 articles, their 741 answerable questions
asked as ``User: q\\nAssistant:``, against three other articles' questions and paragraphs per
paragraph; ``python -m benchmarks.thought.scope_tune``): at ``COMMON_CB = 250``
and threshold 0.15, 98.8% of a paragraph's own questions are in scope, 1.2% of other articles'
questions and none of 450 other paragraphs read with a question; at 0.2, 97.8% and 0.4%.
The benchmark that judges it (``benchmarks/thought/noharm.py``) never saw them.

The rules are English ones, as the cloze questions' are: in another language every word is
unlisted, weighs the most, and coverage counts shared words alike, function words included
(a scope that admits more queries, never an error).
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ctxc.core.errors import CtxcError

__all__ = [
    "COMMON_CB",
    "SCOPE_FILE",
    "THRESHOLD",
    "UNLISTED_CB",
    "Scope",
    "rarity",
    "terms",
    "words",
]

SCOPE_FILE = "scope.json"
_FORMAT = "ctxc-scope/1"
# Words more frequent than 10^-2.5 in English weigh nothing (about 300 words; the module doc).
COMMON_CB = 250
# A word wordfreq's small English list does not hold (below about 10^-6, or not English).
UNLISTED_CB = 800
# The least coverage of a query in scope (chosen on data the benchmarks do not use: module doc).
THRESHOLD = 0.15
# wordfreq 3.1.1's data/small_en.msgpack.gz (Robyn Speer, CC BY-SA 4.0), one "word<TAB>cB"
# line per word, most frequent first (compiler/resources/README.md).
_WORDS = "wordfreq_en.tsv.gz"


def words(text: str) -> list[str]:
    """The lower-cased word characters' runs (``\\w+``) of ``text``: the router's BM25 terms
    and the scope's words."""
    return re.findall(r"\w+", text.lower())


def terms(text: str) -> frozenset[str]:
    """The distinct :func:`words` of ``text``."""
    return frozenset(words(text))


@functools.cache
def _rarities() -> dict[str, int]:
    """Each listed English word's rarity in centibels below one (read once)."""
    raw = resources.files("ctxc").joinpath("resources").joinpath(_WORDS).read_bytes()
    got: dict[str, int] = {}
    for line in gzip.decompress(raw).decode("utf-8").splitlines():
        word, cb = line.split("\t")
        got.setdefault(word, int(cb))  # the list's first (most frequent) entry wins
    return got


def rarity(word: str) -> int:
    """``word``'s rarity in English in centibels below one (:data:`UNLISTED_CB` unlisted)."""
    return _rarities().get(word, UNLISTED_CB)


def _weight(word: str) -> float:
    """The information a word carries about which text it comes from (0 for common words)."""
    return max(0, rarity(word) - COMMON_CB) / 100


@dataclass(frozen=True)
class Scope:
    """The queries a bake's context is about: the context's words and the least coverage.

    Attributes:
        words: the context's distinct words (:func:`terms`).
        threshold: the least coverage of a query in scope, in [0, 1] (0 admits every query).
    """

    words: frozenset[str]
    threshold: float = THRESHOLD

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise CtxcError(f"the scope threshold must be in [0, 1], not {self.threshold}")

    @classmethod
    def of(cls, context: str, threshold: float = THRESHOLD) -> Scope:
        """The scope of a context's text."""
        return cls(terms(context), threshold)

    def coverage(self, query: str, ignore: frozenset[str] = frozenset()) -> float:
        """The share of ``query``'s word information the context holds, in [0, 1] (0 for a
        query of common words alone: nothing in it names the context); the words ``ignore``
        (a chat template's own: ``user``, ``assistant``) are not the query's."""
        weights = {w: _weight(w) for w in terms(query) - ignore}
        # fsum: exactly rounded, so a set's iteration order never changes the last bit.
        total = math.fsum(weights.values())
        if total == 0:
            return 0.0
        return math.fsum(v for w, v in weights.items() if w in self.words) / total

    def admits(self, query: str, ignore: frozenset[str] = frozenset()) -> bool:
        """Whether the patch should answer ``query`` (its coverage reaches the threshold)."""
        return self.coverage(query, ignore) >= self.threshold

    def union(self, other: Scope) -> Scope:
        """The scope of both contexts (a routed bake's chunks), at this one's threshold."""
        return Scope(self.words | other.words, self.threshold)

    def to_dict(self) -> dict:
        """``scope.json``'s content."""
        return {
            "format": _FORMAT,
            "threshold": self.threshold,
            "common_cb": COMMON_CB,
            "unlisted_cb": UNLISTED_CB,
            "words": sorted(self.words),
        }

    def save(self, folder: Path) -> None:
        """Write ``folder/scope.json``."""
        text = json.dumps(self.to_dict(), indent=0, ensure_ascii=False) + "\n"
        (Path(folder) / SCOPE_FILE).write_text(text, encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> Scope:
        """The scope of a bake folder; one line when it has none or it is not one."""
        path = Path(folder) / SCOPE_FILE
        if not path.is_file():
            raise CtxcError(
                f"{folder} has no {SCOPE_FILE}: bake it again with this ctxc to gate its queries"
            )
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if doc.get("format") != _FORMAT:
                raise ValueError(f"format {doc.get('format')!r}")
            if (doc["common_cb"], doc["unlisted_cb"]) != (COMMON_CB, UNLISTED_CB):
                raise ValueError("weighed with other word weights")
            return cls(frozenset(str(w) for w in doc["words"]), float(doc["threshold"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise CtxcError(f"{path} is not a ctxc scope ({exc})") from None
