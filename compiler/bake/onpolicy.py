"""On-policy fit rows: the patched model's own answers, read by the full-context model (issue 35).

A fit sees the teacher's answers only: every fitted position follows tokens the full-context
model wrote. Fed a question alone, the patched model writes its own answer, and once that
drifts from anything the teacher wrote it reaches states no row constrained: on
SmolLM2-135M-Instruct in chat it fell into loops ("The first true engine that was commercially
successful was the first true engine that was ...", "400 Premier League Premier League ...")
that neither the full-context nor the unpatched model writes. This is exposure bias, and the
remedy is DAgger's (Ross et al., 2011): let the learner answer, have the teacher label the
states the learner visits, refit on both. Here each fitted question (self-study, cloze, an
answered chat turn) is asked once more, the patched model answers it greedily, and that
question + answer becomes a fit query whose targets the full-context model gives on
``context + question + answer``, read as its question's row was (a cloze question's with the
question and its span shown before it, ``BakeOptions.cloze_teacher``: so the teacher still
points the answer at the span). The second fit solves over the old rows and these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ctxc.bake.data import FitData, stacked
from ctxc.bake.selfstudy import continue_rows
from ctxc.bake.sources.registry import asked_kinds
from ctxc.core.vocabulary import ON_POLICY_KIND
from ctxc.passes.runtime.run_graph import BlockTargets
from ctxc.patch import Patch

__all__ = ["ON_POLICY_KIND", "asked_queries", "joined_targets", "with_own_answers"]


def asked_queries(data: FitData) -> list[int]:
    """Indices of ``data``'s queries that are a question and its answer (``answer_from > 0``,
    of a source that asks: ``ctxc.bake.sources.base.Source.asks``)."""
    if data.answer_from is None:
        return []
    kinds = asked_kinds()
    return [
        i
        for i, (kind, start) in enumerate(zip(data.kinds, data.answer_from, strict=True))
        if kind in kinds and start > 0
    ]


def with_own_answers(
    model: torch.nn.Module,
    data: FitData,
    patch: Patch,
    answer_tokens: int,
    cut: Callable[[list[int]], list[int]],
) -> FitData:
    """``data`` and, per question query, that question followed by the patched model's answer.

    The patched model is fed what it is fed at its use (``data.prefix`` + the question), in one
    greedy batch of ``answer_tokens``; each answer is cut as the teacher's answers were
    (``cut``: after a line break or special token in plain text, after the end of turn in
    chat). ``model`` is left as it was (the patch is applied for the batch only).

    Args:
        model: the model the patch was fitted on.
        data: the fit data (``answer_from`` marks the questions).
        patch: the first fit's patch.
        answer_tokens: tokens per answer.
        cut: an answer's ids -> the ids kept.

    Returns:
        a new :class:`FitData`: ``data``'s queries, then the new ones (kind
        :data:`ON_POLICY_KIND`, ``answer_from`` their question's length, ``shown`` their
        question's).
    """
    asked = asked_queries(data)
    if not asked:
        return data
    starts = data.answer_from or []  # not empty: asked_queries found answers in it
    questions = [data.queries[i][: starts[i]] for i in asked]
    with torch.no_grad(), patch.applied(model):
        got = _greedy(model, data.prefix, questions, answer_tokens, cut)
    own = [q + cut([int(t) for t in a]) for q, a in zip(questions, got, strict=True)]
    # Each answer is read as its question's was: a cloze question's after its span was shown.
    shown = None if data.shown is None else [*data.shown, *(data.shown_before(i) for i in asked)]
    return FitData(
        data.context_ids,
        data.prefix,
        [*data.queries, *own],
        [*data.kinds, *[ON_POLICY_KIND] * len(own)],
        data.opening,
        [*starts, *(len(q) for q in questions)],
        shown,
    )


def _greedy(model, prefix: list[int], questions: list[list[int]], steps: int, cut) -> list:
    """Each question's greedy answer after ``prefix``, in one batch; with no prefix (a template
    with no opening: Qwen 3), after its own first token, a batch per first token."""

    def until(a: list[int]) -> bool:
        return len(cut(a)) < len(a)

    if prefix:
        return continue_rows(model, prefix, questions, steps, until=until)
    got: list = [None] * len(questions)
    for first in dict.fromkeys(q[0] for q in questions):
        idx = [i for i, q in enumerate(questions) if q[0] == first]
        rows = continue_rows(model, [first], [questions[i][1:] for i in idx], steps, until=until)
        for i, row in zip(idx, rows, strict=True):
            got[i] = row
    return got


def joined_targets(
    first: dict[str, BlockTargets], then: dict[str, BlockTargets]
) -> dict[str, BlockTargets]:
    """Per block, ``first``'s rows then ``then``'s (targets are stacked by query, so those of
    ``data.part(0, n)`` and ``data.part(n)`` join into ``data``'s)."""
    return {path: stacked([a, then[path]]) for path, a in first.items()}
