"""The query file's lines (``--queries``): each text as the format feeds a query; in a fit's
chat bake followed by the full-context model's answer (``FitContext.answer``)."""

from __future__ import annotations

from ctxc.bake.sources.base import Plan, Rows, Source
from ctxc.bake.sources.context import FitContext
from ctxc.core.vocabulary import FILE_KIND

__all__ = ["QueryFile"]


class QueryFile(Source):
    kind = FILE_KIND
    label = "queries"
    asks = True

    def plan(self, ctx: FitContext) -> Plan:
        asked = ctx.ask(ctx.queries) if ctx.queries else []
        extra = ctx.options.answer_tokens if ctx.answer else 0
        longest = max((len(q) + extra for q in asked), default=0)
        return Plan(len(asked), longest, runs=bool(asked) and ctx.answer, draft=Rows(asked))

    def rows(self, ctx: FitContext, plan: Plan) -> Rows:
        asked = super().rows(ctx, plan).queries
        if not ctx.answer:
            return Rows(asked)
        # Where each answer starts: after its question's turn (a held-out turn is all question).
        return Rows(ctx.answered(asked), [len(q) for q in asked])
