"""The one loop: every registered source's rows, in order, as one ``FitData``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import ctxc.bake.sources.registry as registry
from ctxc.bake.data import FitData
from ctxc.bake.selfstudy import context_run
from ctxc.bake.sources.base import Plan, Rows, Source
from ctxc.bake.sources.context import FitContext
from ctxc.models.load import check_length

__all__ = ["counted", "gather"]


def gather(
    ctx: FitContext,
    stage: Callable[[str], None] | None = None,
    sources: Sequence[Source] | None = None,
) -> FitData:
    """The fit data of ``ctx``: each source's rows after the previous source's.

    Every source plans first (no model run), so an input past the model's positions is refused
    before any run; the context runs once when more than one source continues it.

    Args:
        ctx: the bake's :class:`~ctxc.bake.sources.context.FitContext`.
        stage: progress callback: ``fit data: <count> <label>, ...``, before any model run.
        sources: the sources, in order; None: ``registry.SOURCES``.

    Returns:
        the :class:`~ctxc.bake.data.FitData` (``shown`` None when no row shows anything).

    Raises:
        CtxcError: an input past the model's positions, a query that tokenizes to nothing.
    """
    sources = registry.SOURCES if sources is None else tuple(sources)
    plans = [s.plan(ctx) for s in sources]
    if stage is not None:
        stage(f"fit data: {counted(sources, plans)}")
    longest = max((p.longest for p in plans), default=0)
    check_length(ctx.model, len(ctx.context_ids) + longest, "context + longest query")
    if sum(p.runs for p in plans) > 1:
        ctx = replace(ctx, start=context_run(ctx.model, ctx.context_ids))
    made = [s.rows(ctx, p) if p.count else Rows([]) for s, p in zip(sources, plans, strict=True)]
    return _joined(ctx, sources, made)


def counted(sources: Sequence[Source], plans: Sequence[Plan]) -> str:
    """``16 self-study questions, 64 cloze queries, 16 samples``: each source's count (those
    that give rows)."""
    parts = [f"{p.count} {s.label}" for s, p in zip(sources, plans, strict=True) if p.count]
    return ", ".join(parts) or "no queries"


def _joined(ctx: FitContext, sources: Sequence[Source], made: Sequence[Rows]) -> FitData:
    queries: list[list[int]] = []
    kinds: list[str] = []
    starts: list[int] = []
    shown: list[list[int]] = []
    for source, rows in zip(sources, made, strict=True):
        n = len(rows.queries)
        for name, part in (("answer_from", rows.answer_from), ("shown", rows.shown)):
            if part is not None and len(part) != n:
                raise ValueError(f"the {source.kind} source gave {len(part)} {name} for {n} rows")
        queries += rows.queries
        kinds += [source.kind] * n
        starts += rows.answer_from if rows.answer_from is not None else [0] * n
        shown += rows.shown if rows.shown is not None else [[] for _ in range(n)]
    return FitData(
        list(ctx.context_ids),
        list(ctx.prefix),
        queries,
        kinds,
        opening=ctx.opening,
        answer_from=starts,
        shown=shown if any(shown) else None,
    )
