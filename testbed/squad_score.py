"""SQuAD's official answer scoring: normalised exact match and token F1, best over the golds.

As the SQuAD v2.0 evaluation script (``evaluate-v2.0.py``) computes them for an answerable
question: both texts are normalised (lower case, punctuation removed, the articles ``a``, ``an``,
``the`` dropped as words, white space collapsed); exact match is equality of the normalised
texts; F1 is the harmonic mean of precision and recall over the normalised tokens (a multiset
overlap); with several gold answers, the best of each figure over them. Gold answers that
normalise to nothing are dropped, and a question left with none is scored against ``""``.
Shared by ``benchmarks/thought/squad.py`` and its test (``tests/project/test_squad_score.py``).
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence

__all__ = ["contains", "degenerate", "exact_match", "f1", "normalize", "score", "tokens"]

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize(text: str) -> str:
    """Lower case, punctuation removed, articles dropped, white space collapsed (official)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def tokens(text: str) -> list[str]:
    """The normalised text's tokens (empty for an empty text)."""
    return normalize(text).split() if text else []


def exact_match(prediction: str, gold: str) -> int:
    """1 when the normalised texts are equal, else 0."""
    return int(normalize(gold) == normalize(prediction))


def f1(prediction: str, gold: str) -> float:
    """Token F1 of the normalised texts; when either has no token, 1.0 if both have none."""
    pred, want = tokens(prediction), tokens(gold)
    if not pred or not want:
        return float(pred == want)
    common = collections.Counter(pred) & collections.Counter(want)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(want)
    return 2 * precision * recall / (precision + recall)


def score(prediction: str, golds: Sequence[str]) -> tuple[int, float]:
    """``(EM, F1)`` of a prediction: the best over the gold answers that normalise to
    something (``[""]`` when none does, as the official script does)."""
    kept = [g for g in golds if normalize(g)] or [""]
    return max(exact_match(prediction, g) for g in kept), max(f1(prediction, g) for g in kept)


def contains(prediction: str, golds: Sequence[str]) -> int:
    """1 when a gold answer, normalised, is a run of whole words of the normalised prediction
    (an answer in a sentence, as a chat model gives it: "The Norse leader was Rollo."), else 0.
    """
    words = f" {normalize(prediction)} "
    return int(any(normalize(g) and f" {normalize(g)} " in words for g in golds))


def degenerate(text: str) -> bool:
    """Garbage rather than a sentence: a word three times running ("in in in"), a run of four
    words three times over (a loop: "the first true engine that was ... the first true engine
    that was ..."), or fewer than half of its words holding a letter."""
    words = tokens(text)
    if not words:
        return False
    if any(words[i] == words[i + 1] == words[i + 2] for i in range(len(words) - 2)):
        return True
    runs = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    if runs and max(runs.count(r) for r in runs) >= 3:
        return True
    return sum(any(c.isalpha() for c in w) for w in text.split()) < len(text.split()) / 2
