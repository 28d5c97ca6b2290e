"""``ctxc.bake.chunks``: an additive thought patch, baked, extended and cut chunk by chunk.

A chunk is one context (a ``--context`` file) with its own fit data, drawn from the model fed
that chunk alone. ``method="additive"`` sums every chunk's statistics
(:mod:`ctxc.bake.statistics`) and solves the patch from the sums: adding a chunk costs its own
fit data, full runs and teacher-forced runs, plus one solve from the sums (per linear, of the
size of its weight: independent of the chunks already in); removing one gathers its share
again from the fit data kept for it and subtracts it. Chunks added one by one sum, in the same
order, the same float64 terms as a bake of them together: the same statistics, the same patch.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ctxc._version import __version__
from ctxc.bake.data import FitData
from ctxc.bake.driver import fit_blocks, fit_data, patch_meta, query_rows
from ctxc.bake.serve import pad_to_rank
from ctxc.bake.statistics import Chunk, Statistics, chunk_id, gather, solve
from ctxc.bake.targets import cached_fit_targets
from ctxc.core.errors import CtxcError, OptionError
from ctxc.core.options import BakeOptions
from ctxc.core.vocabulary import ADDITIVE_METHOD
from ctxc.patch import Patch

__all__ = ["ChunkBake", "bake_chunks", "find_chunk", "fit_rows", "remove_chunk"]


@dataclass(frozen=True)
class ChunkBake:
    """What :func:`bake_chunks` and :func:`remove_chunk` return.

    Attributes:
        patch: the patch solved from ``stats`` (``update`` ``bake-additive``; its
            ``context_ids`` every chunk's, in order, the later ones without their prefix).
        stats: the summed statistics and their chunks.
        data: the fit data of the last chunk gathered (None after a removal).
        report: JSON-ready figures: options, chunks, each linear's relative residual, timings.
    """

    patch: Patch
    stats: Statistics
    data: FitData | None
    report: dict


def fit_rows(data: FitData, o: BakeOptions) -> torch.Tensor:
    """[N] bool: the fitted positions of ``data`` under ``o`` (as the sequential fit's)."""
    answers = o.fit_rows == "answers"
    if o.fit_prefix and not data.opening and not answers:
        return torch.ones(data.positions, dtype=torch.bool)
    return query_rows(data, o.fit_prefix, answers)


def bake_chunks(
    model: torch.nn.Module,
    tokenizer,
    contexts: Sequence[tuple[str, list[int]]],
    queries: Sequence[str] | None = None,
    *,
    options: BakeOptions | None = None,
    start: Statistics | None = None,
    datas: Sequence[FitData] | None = None,
    on_stage: Callable[[str], None] | None = None,
    on_block: Callable[[int, int, str], None] | None = None,
) -> ChunkBake:
    """Gather each chunk's statistics, add them to ``start``'s, and solve the patch.

    Args:
        model: the unpatched causal LM (float32 advised).
        tokenizer: its tokenizer (the fit data's prefix, the query file).
        contexts: ``(name, context ids)`` per chunk, in order (ignored with ``datas``).
        queries: fit query texts, fitted against every chunk (besides its sampled data).
        options: :class:`BakeOptions` with ``method="additive"``; with ``start``, its own.
        start: the statistics to add to (``--add``), or None (a new patch).
        datas: ready fit data per chunk instead of ``contexts`` (their names ``chunk-i``).
        on_stage: progress callback with a stage name.
        on_block: progress callback ``(done, total, block)`` of the teacher-forced runs.

    Returns:
        the :class:`ChunkBake`.

    Raises:
        CtxcError: no chunk, a chunk already in ``start``, options that are not additive, a
            model whose blocks cannot be fitted so.
    """
    o = BakeOptions(**start.options) if start is not None else options or BakeOptions()
    if o.method != ADDITIVE_METHOD:
        raise OptionError("chunks add up in {method} additive only (the fit is sequential)")
    stage = on_stage or (lambda _name: None)
    items: list[tuple[str, list[int], FitData | None]]
    if datas is not None:
        items = [(f"chunk-{i}", d.context_ids, d) for i, d in enumerate(datas)]
    else:
        items = [(name, list(ids), None) for name, ids in contexts]
    if not items:
        raise CtxcError("no context chunk to bake")
    have = set(start.ids if start is not None else ())
    for name, ids, _ in items:
        if not ids:
            raise CtxcError(f"the context {name} is empty")
        if chunk_id(ids) in have:
            raise CtxcError(f"{name}: chunk {chunk_id(ids)} is in the patch already")
        have.add(chunk_id(ids))
    timings: dict[str, float] = {}
    traced, blocks = fit_blocks(model, o)
    total, data = start, None
    for name, ids, ready in items:
        clock = time.perf_counter()
        data = ready if ready is not None else fit_data(model, tokenizer, ids, queries, o, stage)
        _tick(timings, "data", clock)
        stats = _gather(model, traced, blocks, data, o, name, stage, on_block, timings)
        total = stats if total is None else total.plus(stats)
    assert total is not None
    return _solved(model, traced.dtype, total, o, data, timings)


def remove_chunk(
    model: torch.nn.Module,
    stats: Statistics,
    which: str,
    *,
    on_stage: Callable[[str], None] | None = None,
    on_block: Callable[[int, int, str], None] | None = None,
) -> ChunkBake:
    """``stats`` without the chunk ``which`` (its id, or its name when unique): its share
    gathered again from its kept fit data and subtracted; the patch solved again.

    Raises:
        CtxcError: no such chunk, or the patch's only one.
    """
    o = BakeOptions(**stats.options)
    chunk = find_chunk(stats, which)
    timings: dict[str, float] = {}
    traced, blocks = fit_blocks(model, o)
    share = _gather(
        model,
        traced,
        blocks,
        chunk.data,
        o,
        chunk.name,
        on_stage or (lambda _n: None),
        on_block,
        timings,
    )
    return _solved(model, traced.dtype, stats.minus(share), o, None, timings)


def find_chunk(stats: Statistics, which: str) -> Chunk:
    """The chunk ``which`` (its id, or its name when unique) that can be removed from ``stats``.

    Raises:
        CtxcError: no such chunk, several, or the patch's only one.
    """
    found = [c for c in stats.chunks if which in (c.id, c.name)]
    if len(found) != 1:
        have = ", ".join(f"{c.id} ({c.name})" for c in stats.chunks)
        got = "no chunk" if not found else "more than one chunk"
        raise CtxcError(f"{got} is {which!r}; the patch holds {have}")
    if len(stats.chunks) == 1:
        raise CtxcError(f"chunk {found[0].id} is the patch's only one: nothing would be left")
    return found[0]


def _gather(model, traced, blocks, data, o, name, stage, on_block, timings) -> Statistics:
    """One chunk's statistics (its full runs, then its teacher-forced runs)."""
    clock = time.perf_counter()
    stage(f"full runs: {name}")
    targets = cached_fit_targets(model, traced, blocks, data)
    _tick(timings, "targets", clock)
    clock = time.perf_counter()
    stage(f"statistics: {name}")
    stats = gather(traced, blocks, targets, data, fit_rows(data, o), o, name, on_block)
    _tick(timings, "statistics", clock)
    return stats


def _solved(model, dtype, total: Statistics, o, data, timings) -> ChunkBake:
    """The patch of ``total`` and the report."""
    clock = time.perf_counter()
    deltas, residuals = solve(total, o.ridge, o.rank)
    first = total.chunks[0].data
    meta = patch_meta(model, dtype, first, o)
    meta = dataclasses.replace(meta, context_ids=_joined(total.chunks))
    patch = Patch(deltas, meta)
    if o.rank is not None:
        patch = pad_to_rank(patch, o.rank)
    _tick(timings, "solve", clock)
    report = {
        "options": asdict(o),
        "chunks": [
            {
                "id": c.id,
                "name": c.name,
                "context_tokens": len(c.data.context_ids),
                "fit_queries": len(c.data.queries),
                "fit_positions": c.data.positions,
            }
            for c in total.chunks
        ],
        "move_residuals": residuals,
        "statistics_bytes": sum(t.numel() * t.element_size() for t in total.sums.values()),
        "timings": timings,
        "ctxc_version": __version__,
    }
    if data is not None:
        report.update(
            context_tokens=len(data.context_ids),
            fit_queries=len(data.queries),
            fit_positions=data.positions,
            fit_kinds={k: data.kinds.count(k) for k in sorted(set(data.kinds))},
        )
    return ChunkBake(patch, total, data, report)


def _joined(chunks: Sequence[Chunk]) -> list[int]:
    """Every chunk's context ids in order, each later one without the prefix (its BOS)."""
    ids = list(chunks[0].data.context_ids)
    for c in chunks[1:]:
        p, own = c.data.prefix, c.data.context_ids
        ids += own[len(p) :] if own[: len(p)] == p else own
    return ids


def _tick(timings: dict[str, float], name: str, clock: float) -> None:
    timings[name] = round(timings.get(name, 0.0) + time.perf_counter() - clock, 3)
