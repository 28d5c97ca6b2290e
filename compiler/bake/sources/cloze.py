"""Cloze: extractive questions whose answer is a span of the context (``ctxc.bake.cloze``);
with ``BakeOptions.cloze_teacher`` ``shown`` the full-context model reads each before itself."""

from __future__ import annotations

from ctxc.bake.sources.base import Plan, Rows, Source
from ctxc.bake.sources.context import FitContext
from ctxc.core.vocabulary import CLOZE_KIND

__all__ = ["Cloze"]


class Cloze(Source):
    kind = CLOZE_KIND
    label = "cloze queries"
    asks = True

    def plan(self, ctx: FitContext) -> Plan:
        o = ctx.options
        asked, starts = ctx.cloze() if o.clozed else ([], [])
        shown = [list(q) for q in asked] if o.cloze_teacher == "shown" else None
        reads = 1 if shown is None else 2  # shown: the full input holds each query twice
        longest = max((reads * len(q) for q in asked), default=0)
        return Plan(len(asked), longest, draft=Rows(asked, starts, shown))
