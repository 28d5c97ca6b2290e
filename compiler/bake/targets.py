"""The fit's targets from one context run, its KV cache continued by every query (batched).

:func:`~ctxc.bake.data.record_fit_targets` runs the traced graph over ``context + q`` for each
fit query: the context is recomputed once per query (K = 32 queries of 32 tokens after a
390-token context: 13x the work the queries need) and the FX interpreter runs one query at a
time. Here the context runs once through the model itself, its cache is repeated across a batch
of equal-length queries, and forward hooks read each block's MLP input ``z`` (the first inner
linear's input) and output ``y`` (the decoder layer's output, the module above the MLP). The
same values up to rounding (the cache and the batch change the summation order only), checked
on the first query against the graph's recording: a model whose layer output is not the block's
residual add (a trailing post-LN, an extra op after the add) fails the check and is recorded by
the graph, query by query, as before. A block with an attention surface also gets ``v``, the
residual after its attention: the input of the norm that makes ``z`` (Gemma's pre-feedforward
norm), checked the same way.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Collection

import torch

from ctxc.bake.data import FitData, padded, record_fit_targets, stacked
from ctxc.core.thresholds import BAKE_TARGETS_RTOL
from ctxc.frontend.trace import TracedModel
from ctxc.models.kv_cache import cache_of, with_cache
from ctxc.passes.locate.block_map import BlockMap
from ctxc.passes.runtime.run_graph import BlockTargets

__all__ = ["CHECK_TOL", "cached_fit_targets", "own_targets"]

CHECK_TOL = BAKE_TARGETS_RTOL  # relative max difference to the graph's recording
_BATCH = 16  # queries per batched forward


class _Hooks:
    """Forward hooks that keep every block's ``z``, ``y`` (and ``v``) of the last forward."""

    def __init__(self, model: torch.nn.Module, blocks: BlockMap):
        self.z: dict[str, torch.Tensor] = {}
        self.y: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.handles = []
        for b in blocks.blocks:
            inner = model.get_submodule(b.inner[0].module)
            layer = model.get_submodule(b.path.rsplit(".", 1)[0])
            self.handles.append(inner.register_forward_pre_hook(self._keep(self.z, b.path)))
            self.handles.append(layer.register_forward_hook(self._keep_out(self.y, b.path)))
            if b.attention is not None and b.pre_norm is not None:
                pre = model.get_submodule(b.pre_norm)
                self.handles.append(pre.register_forward_pre_hook(self._keep(self.v, b.path)))

    @staticmethod
    def _keep(store: dict, path: str):
        def hook(_module, args):
            store[path] = args[0].detach()

        return hook

    @staticmethod
    def _keep_out(store: dict, path: str):
        def hook(_module, _args, out):
            store[path] = (out[0] if isinstance(out, tuple | list) else out).detach()

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _cached_rows(model: torch.nn.Module, blocks: BlockMap, data: FitData) -> dict[str, list]:
    """Per block, per query: its :class:`BlockTargets` at the reduced input's positions."""
    device = next(model.parameters()).device
    p, h = len(data.prefix), data.head  # h: the prefix's positions matched to the context's
    out: dict[str, list] = {b.path: [None] * len(data.queries) for b in blocks.blocks}
    groups: dict[int, list[int]] = defaultdict(list)
    # Each query continues the context's cache with what is shown before it, then itself.
    rows = [data.shown_before(i) + q for i, q in enumerate(data.queries)]
    for i, row in enumerate(rows):
        groups[len(row)].append(i)
    hooks = _Hooks(model, blocks)
    try:
        with torch.no_grad():
            ctx = torch.tensor([data.context_ids], device=device)
            first = model(input_ids=ctx, use_cache=True, logits_to_keep=1)
            # The context's last h rows (an opening's unmatched positions copy the first).
            head = (
                {b: padded(_rows_of(hooks, b, 0, slice(-h, None)), p - h) for b in out} if h else {}
            )
            for members in groups.values():
                for start in range(0, len(members), _BATCH):
                    idx = members[start : start + _BATCH]
                    cache = copy.deepcopy(cache_of(first))
                    cache.batch_repeat_interleave(len(idx))
                    x = torch.tensor([rows[i] for i in idx], device=device)
                    model(input_ids=x, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
                    for b in out:
                        for j, i in enumerate(idx):
                            n = len(data.queries[i])
                            if not data.shown_before(i):
                                tg = _rows_of(hooks, b, j, slice(None))
                                out[b][i] = stacked([head[b], tg]) if h else tg
                                continue
                            # The matched positions are the input's last: the shown text's
                            # last h before the query's own (as record_fit_targets takes them).
                            tg = _rows_of(hooks, b, j, slice(len(rows[i]) - n - h, None))
                            out[b][i] = padded(tg, p - h)
    finally:
        hooks.remove()
    return out


def _rows_of(hooks: _Hooks, path: str, row: int, positions: slice) -> BlockTargets:
    """One batch row's hooked values of block ``path`` at ``positions``, on the CPU."""
    v = hooks.v.get(path)
    return BlockTargets(
        z=hooks.z[path][row, positions].cpu(),
        y=hooks.y[path][row, positions].cpu(),
        v=v[row, positions].cpu() if v is not None else None,
    )


def _agrees(got: dict[str, list], want: dict[str, BlockTargets]) -> bool:
    """Query 0's hooked rows against the graph's, relative max difference per block."""
    for path, tg in want.items():
        mine = got[path][0]
        if (mine.v is None) != (tg.v is None):
            return False
        pairs = [(mine.z, tg.z), (mine.y, tg.y)]
        if tg.v is not None:
            pairs.append((mine.v, tg.v))
        for a, b in pairs:
            if a.shape != b.shape:
                return False
            scale = float(b.float().abs().max()) or 1.0
            if float((a.float() - b.float()).abs().max()) > CHECK_TOL * scale:
                return False
    return True


def cached_fit_targets(
    model: torch.nn.Module, traced: TracedModel, blocks: BlockMap, data: FitData
) -> dict[str, BlockTargets]:
    """:func:`~ctxc.bake.data.record_fit_targets`'s result, from one cached context run.

    Args:
        model: the unpatched model (hooks are added for the run and removed).
        traced: its export (the first query is recorded by it too, as the check).
        blocks: its blocks.
        data: the fit data.

    Returns:
        block path -> stacked :class:`BlockTargets` (rows query by query, as the graph's).
    """
    first = data.part(0, 1)
    want = record_fit_targets(traced, blocks, first)
    got = _cached_rows(model, blocks, data)
    if not _agrees(got, want):
        return record_fit_targets(traced, blocks, data)
    dtype = {p: tg.z.dtype for p, tg in want.items()}
    return {p: _cast(stacked(rows), dtype[p]) for p, rows in got.items()}


def own_targets(
    model: torch.nn.Module,
    traced: TracedModel,
    blocks: BlockMap,
    data: FitData,
    targets: dict[str, BlockTargets],
    kinds: Collection[str],
) -> dict[str, BlockTargets]:
    """``targets`` with the rows of ``kinds`` replaced by the unpatched model's own values on
    what the patched model is fed for them (prefix + query, no context): fitted, the patch is
    held to change nothing at those rows (``BakeOptions.off_topic_targets`` ``none``).

    The same recording as :func:`cached_fit_targets` (its check included), of the rows alone
    with the prefix as their context: ``full(i) = reduced(i)``.

    Args:
        model: the unpatched model.
        traced: its export.
        blocks: its blocks.
        data: the fit data ``targets`` were recorded for.
        targets: block path -> stacked targets, rows query by query (a longer set's rows after
            ``data``'s are kept as they are).
        kinds: the query kinds to replace.

    Returns:
        block path -> stacked :class:`BlockTargets` (``targets`` itself when no row is of
        ``kinds``).
    """
    picked = [i for i, k in enumerate(data.kinds) if k in kinds]
    if not picked:
        return targets
    own = cached_fit_targets(model, traced, blocks, data.alone(picked))
    sizes = [len(data.prefix) + len(q) for q in data.queries]  # each query's rows, in order
    replaced = set(picked)
    out: dict[str, BlockTargets] = {}
    for path, tg in targets.items():
        mine, parts, at, own_at = own[path], [], 0, 0
        for i, n in enumerate(sizes):
            if i in replaced:  # the next of ``own``'s rows (the picked rows, in order)
                parts.append(_rows(mine, own_at, own_at + n))
                own_at += n
            else:
                parts.append(_rows(tg, at, at + n))
            at += n
        parts.append(_rows(tg, at, tg.z.shape[0]))
        out[path] = _cast(stacked(parts), tg.z.dtype)
    return out


def _rows(tg: BlockTargets, start: int, stop: int) -> BlockTargets:
    """Rows ``[start:stop]`` of ``tg``."""
    v = tg.v[start:stop] if tg.v is not None else None
    return BlockTargets(z=tg.z[start:stop], y=tg.y[start:stop], v=v)


def _cast(tg: BlockTargets, dtype: torch.dtype) -> BlockTargets:
    return BlockTargets(
        z=tg.z.to(dtype), y=tg.y.to(dtype), v=tg.v.to(dtype) if tg.v is not None else None
    )
