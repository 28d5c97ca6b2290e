"""Continuations sampled from the model fed the context (``ctxc.bake.data``)."""

from __future__ import annotations

from ctxc.bake.data import sample_continuations
from ctxc.bake.sources.base import Plan, Rows, Source
from ctxc.bake.sources.context import FitContext
from ctxc.core.vocabulary import SAMPLE_KIND

__all__ = ["Samples"]


class Samples(Source):
    kind = SAMPLE_KIND
    label = "samples"

    def plan(self, ctx: FitContext) -> Plan:
        n = ctx.options.sampled
        return Plan(n, ctx.options.sample_tokens if n else 0, runs=n > 0)

    def rows(self, ctx: FitContext, plan: Plan) -> Rows:
        o = ctx.options
        return Rows(
            sample_continuations(
                ctx.model, ctx.context_ids, plan.count, o.sample_tokens, o.seed, ctx.start
            )
        )
