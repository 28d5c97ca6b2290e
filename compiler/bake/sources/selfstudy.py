"""Self-study: questions the model writes about the context, answered with it in view
(``ctxc.bake.selfstudy``; in chat, ``ctxc.bake.chat.chat_self_study``)."""

from __future__ import annotations

from ctxc.bake.sources.base import Plan, Rows, Source
from ctxc.bake.sources.context import FitContext
from ctxc.core.vocabulary import SELF_STUDY_KIND

__all__ = ["SelfStudy"]


class SelfStudy(Source):
    kind = SELF_STUDY_KIND
    label = "self-study questions"
    asks = True

    def plan(self, ctx: FitContext) -> Plan:
        n = ctx.options.asked + ctx.topics
        longest = ctx.longest_question() + ctx.options.answer_tokens if n else 0
        return Plan(n, longest, runs=n > 0)

    def rows(self, ctx: FitContext, plan: Plan) -> Rows:
        asked, texts = ctx.self_study()
        # Where each answer starts: its question's ids, as the format asks it.
        return Rows(asked, [len(ctx.ask([ctx.question(q)])[0]) for q in texts])
