"""``ctxc.bake.sources``: the fit data as a list of sources (issue 52).

A source is one kind of fit query (the query file's lines, self-study questions, cloze
queries, samples): one module here, one line in :data:`~ctxc.bake.sources.registry.SOURCES`.
Given the bake's :class:`~ctxc.bake.sources.context.FitContext` (model, tokenizer, context,
options, the plain or chat format, the shared context run), it plans (its count and the longest
input it needs, no model run) and gives its rows (:class:`~ctxc.bake.sources.base.Rows`);
:func:`~ctxc.bake.sources.loop.gather` is the one loop that joins them into ``FitData``, for
plain text and chat alike. Where the formats differ, a source asks the context. The on-policy
rows (``ctxc.bake.onpolicy``) are no source: they need the first fit's patch and the other
sources' rows, so they come after the fit; they ask again the rows of the sources that ask
(``Source.asks``). Guide: docs/bake.md, "Adding a fit-data source".
"""

from __future__ import annotations

from ctxc.bake.sources.base import Plan, Rows, Source
from ctxc.bake.sources.context import ChatContext, FitContext, TextContext, fit_context
from ctxc.bake.sources.loop import gather
from ctxc.bake.sources.registry import SOURCES, asked_kinds

__all__ = [
    "SOURCES",
    "ChatContext",
    "FitContext",
    "Plan",
    "Rows",
    "Source",
    "TextContext",
    "asked_kinds",
    "fit_context",
    "gather",
]
