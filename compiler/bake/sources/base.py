"""What a fit-data source is: its rows, its plan and the class every source derives from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from ctxc.bake.sources.context import FitContext

__all__ = ["Plan", "Rows", "Source"]


@dataclass(frozen=True)
class Rows:
    """One source's fit queries, in order (the ``FitData`` fields of its part).

    Attributes:
        queries: each query's ids (after the prefix; no special tokens but a template's).
        answer_from: per query, where its answer starts (its question's length); None: 0 for
            every query (all answer, or no question).
        shown: per query, what the full-context model reads between the context and it
            (``FitData.shown``); None: nothing for every query.
    """

    queries: list[list[int]]
    answer_from: list[int] | None = None
    shown: list[list[int]] | None = None


@dataclass(frozen=True)
class Plan:
    """What a source will give, known before any model run.

    Attributes:
        count: how many rows it gives (self-study: how many questions it asks; a question the
            model fails to write is dropped, so the rows may be fewer).
        longest: the longest input it needs after the context (what the full-context model
            reads of a row, ``shown`` included: ``check_length``'s bound); 0: none.
        runs: it continues the context's run (:attr:`FitContext.start`): when more than one
            source does, the context runs once for all of them.
        draft: rows it made without a model, handed back to :meth:`Source.rows`.
    """

    count: int
    longest: int = 0
    runs: bool = False
    draft: Rows | None = None


class Source:
    """A kind of fit query: one module under ``ctxc.bake.sources``, one entry in
    ``ctxc.bake.sources.registry.SOURCES``.

    Attributes:
        kind: ``FitData.kinds`` of its rows (``report.json``'s ``fit_kinds``).
        label: its rows in the stage line, after their count (``16 samples``).
        asks: its rows are a question then its answer (``answer_from`` > 0): the on-policy
            refit asks the question again (``ctxc.bake.onpolicy``).
    """

    kind: ClassVar[str]
    label: ClassVar[str]
    asks: ClassVar[bool] = False

    def plan(self, ctx: FitContext) -> Plan:
        """Its count and bounds, and the rows it can make without a model (no model run)."""
        raise NotImplementedError

    def rows(self, ctx: FitContext, plan: Plan) -> Rows:
        """Its rows (model runs here, continuing ``ctx.start`` when it is set).

        Args:
            ctx: the bake's context.
            plan: what :meth:`plan` returned for ``ctx``.

        Returns:
            ``plan.count`` rows or fewer (the draft, for a source that needs no model).
        """
        if plan.draft is None:
            raise NotImplementedError(f"the {self.kind} source makes no rows")
        return plan.draft
