"""The data a thought patch is fitted on and judged by: queries, sampled continuations, targets.

A query ``q`` (token ids, no special tokens) is fed to the patched model as ``prefix + q``, the
tokenizer's usual form (its BOS); the original model gets ``context + q``. The last
``len(prefix + q)`` positions of the full input correspond to the patched input's positions (the
BOS position to the context's last token: both predict the query's first token), and each is a
constraint of the fit (issue 13). A chat model's prefix is its template's opening instead
(``FitData.opening``, ``ctxc.bake.chat``): only the opening's last position has a counterpart.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ctxc.core.errors import CtxcError
from ctxc.core.textfile import read_text
from ctxc.frontend.trace import TracedModel
from ctxc.models.kv_cache import cache_of, with_cache
from ctxc.passes.locate.block_map import BlockMap
from ctxc.passes.runtime.run_graph import BlockTargets, record_targets

__all__ = [
    "FitData",
    "padded",
    "read_queries",
    "record_fit_targets",
    "sample_continuations",
    "sample_tokens",
    "special_prefix",
    "stacked",
    "text_queries",
]


@dataclass(frozen=True)
class FitData:
    """Queries for one context, as token ids.

    Attributes:
        context_ids: the context as the tokenizer gives it (with its special tokens).
        prefix: the tokens the tokenizer puts before a text (its BOS), fed before each query.
        queries: each query's ids, without special tokens.
        kinds: per query, the kind of the source that gave it (``ctxc.bake.sources``:
            ``file``, ``self-study``, ``cloze``, ``sample``; ``on-policy``).
        opening: the prefix is a chat template's opening (``ctxc.bake.chat``: what it puts
            before a user turn when there is no context), not a BOS: only its last position is
            matched to the context's last (both predict the query's first token); its other
            positions are run, never fitted or compared. False: each prefix position is
            matched to one of the context's last ``len(prefix)``.
        answer_from: per query, where its answer starts (a self-study query: the length of its
            question's ids; 0 for the others, all answer). None: 0 for every query. With
            ``BakeOptions.fit_rows == "answers"`` only the positions from the one before it
            (which predicts the answer's first token) are fitted.
        shown: per query, what the original model reads between the context and the query
            (``BakeOptions.cloze_teacher`` ``shown``: a cloze query itself, so the targets of
            its second reading give the span); None: nothing for every query. The matched
            positions are the full input's last ones whatever it holds.
    """

    context_ids: list[int]
    prefix: list[int]
    queries: list[list[int]]
    kinds: list[str]
    opening: bool = False
    answer_from: list[int] | None = None
    shown: list[list[int]] | None = None

    def reduced(self, i: int) -> list[int]:
        """What the patched model is fed for query ``i``."""
        return self.prefix + self.queries[i]

    def full(self, i: int) -> list[int]:
        """What the original model is fed for query ``i``."""
        return self.context_ids + self.shown_before(i) + self.queries[i]

    def shown_before(self, i: int) -> list[int]:
        """What the original model reads between the context and query ``i`` (often none)."""
        return [] if self.shown is None else self.shown[i]

    def part(self, start: int, stop: int | None = None) -> FitData:
        """The same context and prefix with queries ``[start:stop]`` (their kinds too)."""
        q, k = self.queries[start:stop], self.kinds[start:stop]
        a = None if self.answer_from is None else self.answer_from[start:stop]
        shown = None if self.shown is None else self.shown[start:stop]
        return FitData(self.context_ids, self.prefix, q, k, self.opening, a, shown)

    def alone(self, picked: Sequence[int]) -> FitData:
        """Queries ``picked`` with the prefix as their context (nothing shown): what the
        unpatched model gives on the patched model's own input, ``full(i) = reduced(i)``."""
        a = None if self.answer_from is None else [self.answer_from[i] for i in picked]
        q, k = [self.queries[i] for i in picked], [self.kinds[i] for i in picked]
        return FitData(list(self.prefix), self.prefix, q, k, self.opening, a, None)

    @property
    def head(self) -> int:
        """How many of the prefix's last positions are matched to the context's last ones."""
        return min(len(self.prefix), 1) if self.opening else len(self.prefix)

    def matched(self, i: int) -> int:
        """How many of query ``i``'s reduced input's last positions have a full-run
        counterpart (the fit's targets, the evaluation's reference): ``head`` + the query's."""
        return self.head + len(self.queries[i])

    @property
    def positions(self) -> int:
        """N: the fit's constraints, every position of every reduced input."""
        return sum(len(self.prefix) + len(q) for q in self.queries)


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text (``tokenizer("x")`` minus the text's ids).

    Raises:
        CtxcError: the tokenizer adds tokens after the text (the positions would not align).
    """
    probe = "Hello"
    with_special = list(tokenizer(probe).input_ids)
    plain = list(tokenizer(probe, add_special_tokens=False).input_ids)
    n = len(with_special) - len(plain)
    if n < 0 or with_special[n:] != plain:
        raise CtxcError("the tokenizer adds tokens after a text: bake needs them before it only")
    return with_special[:n]


def read_queries(path: Path) -> list[str]:
    """The non-blank lines of a UTF-8 query file, stripped (``ctxc.core.textfile.read_text``:
    one line naming the file for a missing, unreadable, blank or binary one)."""
    return [line.strip() for line in read_text(path, "query file").splitlines() if line.strip()]


def text_queries(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Each text's ids without special tokens (a leading space joins it to the context)."""
    out = []
    for text in texts:
        ids = list(tokenizer(" " + text.strip(), add_special_tokens=False).input_ids)
        if not ids:
            raise CtxcError(f"query {text!r} tokenizes to no tokens")
        out.append(ids)
    return out


def sample_continuations(
    model: torch.nn.Module,
    context_ids: list[int],
    count: int,
    length: int,
    seed: int,
    start=None,
) -> list[list[int]]:
    """``count`` continuations of ``length`` tokens sampled (temperature 1) from ``model`` fed
    the context; the context is run once and its cache shared by every sample.

    Args:
        model: the unpatched causal LM.
        context_ids: the context ids.
        count: K, the number of samples.
        length: tokens per sample.
        seed: the sampling seed (a ``torch.Generator``: the global RNG is left alone).
        start: the model's output on the context with its cache (``use_cache=True``, the last
            logits), when already computed (left as it was: the cache is copied).

    Returns:
        the samples' ids, [count][length].
    """
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    with torch.no_grad():
        if start is None:
            ids = torch.tensor([context_ids], device=device)
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            cache = cache_of(out)
        else:
            out, cache = start, copy.deepcopy(cache_of(start))
        cache.batch_repeat_interleave(count)
        logits = out.logits[:, -1].float().expand(count, -1)  # [K, vocab]
        picked = []
        for step in range(length):
            tok = sample_tokens(logits, gen)[:, None]  # [K, 1]
            picked.append(tok)
            if step + 1 == length:
                break
            out = model(
                input_ids=tok.to(device),
                **with_cache(model, cache),
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1].float()
    return torch.cat(picked, dim=1).tolist()


def sample_tokens(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row at temperature 1, by the inverse of each row's cumulative distribution.

    ``torch.multinomial`` over a 262k vocabulary took 0.15 s per decode step of 16 rows (2
    threads), more than the step's output projection; one uniform per row searched in the
    cumulative sums, in float64, 0.04 s.

    Args:
        logits: [b, vocab], on any device (sampled on the CPU).
        generator: the seeded CPU RNG (one float64 uniform per row).

    Returns:
        int64 [b].
    """
    x = logits.detach().double().cpu()  # [b, vocab]
    cdf = (x - x.amax(-1, keepdim=True)).exp_().cumsum_(-1)  # [b, vocab], unnormalised
    u = torch.rand(x.shape[0], 1, generator=generator, dtype=torch.float64) * cdf[:, -1:]  # [b, 1]
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max_(x.shape[-1] - 1)


def record_fit_targets(
    traced: TracedModel, blocks: BlockMap, data: FitData
) -> dict[str, BlockTargets]:
    """The full runs' targets at every fit position, rows stacked query by query.

    Returns:
        block path -> stacked :class:`BlockTargets` (``z`` [N, d_in], ``y`` [N, d], ``v``
        [N, d] for a block with an attention surface; an opening's unmatched rows are copies
        of its last, :func:`padded`).
    """
    rows: dict[str, list[BlockTargets]] = {b.path: [] for b in blocks.blocks}
    for i in range(len(data.queries)):
        k = data.matched(i)
        run = record_targets(traced, blocks, torch.tensor([data.full(i)]), k)
        for path, tg in run.targets.items():
            rows[path].append(padded(tg, len(data.reduced(i)) - k))
    return {p: stacked(r) for p, r in rows.items()}


def padded(tg: BlockTargets, rows: int) -> BlockTargets:
    """``tg`` with ``rows`` copies of its first row before it: the rows of an opening's
    unmatched positions (:attr:`FitData.opening`), never fitted (``tg`` itself when 0)."""
    if rows <= 0:
        return tg

    def grow(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:1].expand(rows, *x.shape[1:]), x])

    return BlockTargets(z=grow(tg.z), y=grow(tg.y), v=grow(tg.v) if tg.v is not None else None)


def stacked(rows: Sequence[BlockTargets]) -> BlockTargets:
    """Targets of several queries, rows stacked in order (``v`` where every query has it)."""
    vs = [r.v for r in rows if r.v is not None]
    return BlockTargets(
        z=torch.cat([r.z for r in rows]),
        y=torch.cat([r.y for r in rows]),
        v=torch.cat(vs) if len(vs) == len(rows) else None,
    )
