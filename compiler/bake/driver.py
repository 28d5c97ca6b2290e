"""``ctxc.bake.driver``: one reusable patch per context, fitted over many queries (issue 13).

The bake's driver, as ``compiler/pipeline.py`` is the compile's: the fit data (:func:`fit_data`,
every source of :mod:`ctxc.bake.sources`; :func:`bake_data` for an evaluation's), the full
runs' targets, then the fit or the distillation.

The exact compiler patches one query; a thought patch must serve queries it has never seen. The
fit data are a query file's lines and/or K continuations sampled from the model fed the context;
every position of every query is a constraint. ``method="fit"`` solves the exact moves in the
least-squares sense over all positions, block by block along the patched run
(:func:`~ctxc.passes.solver.fit_solve.fit_solve`); ``method="distill"`` trains a LoRA of the same
rank
by context distillation (:mod:`ctxc.bake.distill`). Both give a :class:`~ctxc.patch.Patch`, so
every backend takes it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from ctxc._version import __version__
from ctxc.bake.chat import ChatFormat, chat_format
from ctxc.bake.data import FitData
from ctxc.bake.onpolicy import joined_targets, with_own_answers
from ctxc.bake.selfstudy import answer_end
from ctxc.bake.serve import check_servable_blocks, pad_to_rank, servable_kinds
from ctxc.bake.sources import fit_context, gather
from ctxc.bake.targets import cached_fit_targets, own_targets
from ctxc.core.errors import CtxcError, OptionError, UnpatchableError
from ctxc.core.options import BakeOptions
from ctxc.core.vocabulary import (
    ADDITIVE_METHOD,
    BOTH_DATA,
    DISTILL_METHOD,
    FIT_METHOD,
    OFF_TOPIC_KINDS,
)
from ctxc.models.fingerprint import fingerprint
from ctxc.passes.runtime.run_graph import BlockTargets
from ctxc.passes.solver.fit_moves import FitOptions
from ctxc.passes.solver.fit_solve import FitSolution, fit_solve
from ctxc.patch import Patch, PatchMeta
from ctxc.runs.shortlist_head import shortlist_head
from ctxc.store.traced import traced_blocks

__all__ = [
    "BakeOptions",
    "BakeResult",
    "bake",
    "bake_data",
    "check_rank",
    "fit_blocks",
    "fit_data",
    "fit_options",
    "patch_meta",
    "query_rows",
    "row_weights",
]


@dataclass(frozen=True)
class BakeResult:
    """What :func:`bake` returns.

    Attributes:
        patch: the thought patch (its ``query_ids`` are the first fit query's).
        data: the fit data.
        fit: the fit's per-block figures (None for ``distill`` from scratch).
        report: JSON-ready figures: options, sizes, per-block fit figures, timings.
        chat: the chat format of a chat context (``messages``), else None.
    """

    patch: Patch
    data: FitData
    fit: FitSolution | None
    report: dict
    chat: ChatFormat | None = None


def bake_data(
    model: torch.nn.Module,
    tokenizer,
    context_ids: list[int],
    queries: Sequence[str] | None,
    samples: int,
    sample_tokens: int,
    seed: int,
    prefix: list[int] | None = None,
    questions: int = 0,
    answer_tokens: int = BakeOptions.answer_tokens,
    question_prompt: str = BakeOptions.question_prompt,
    question_temperature: float = BakeOptions.question_temperature,
    topics: int = 0,
    chat: ChatFormat | None = None,
    answer: bool = False,
    cloze: int = 0,
    cloze_form: str = BakeOptions.cloze_form,
    cloze_teacher: str = BakeOptions.cloze_teacher,
) -> FitData:
    """The fit data of these counts (an evaluation's held-out data: no self-study or cloze
    unless asked): every source of :mod:`ctxc.bake.sources` in order, the query texts' ids,
    ``questions`` self-study queries (seeded ``seed``), ``cloze`` extractive queries, then
    ``samples`` sampled continuations. The other defaults are :class:`BakeOptions`'.

    Args:
        samples: K, at least 0.
        questions: self-study questions, at least 0.
        answer_tokens: greedy answer tokens per self-study question.
        question_prompt, question_temperature, topics, cloze_form, cloze_teacher: as in
            :class:`BakeOptions`.
        chat: a chat model's :class:`~ctxc.bake.chat.ChatFormat`: ``context_ids`` are its
            context turns', each query text is a user turn, self-study asks in turns
            (:func:`~ctxc.bake.chat.chat_self_study`) and the prefix is the template's
            opening (``FitData.opening``); ``prefix`` is then ignored.
        answer: with ``chat``, each query text's turn is followed by the full-context model's
            greedy answer (``answer_tokens``, cut after its end of turn): fit queries; without,
            the turn alone (held-out queries, answered by the evaluation).

    Raises:
        CtxcError: an input past the model's positions.
        OptionError: a bad count or choice (:class:`BakeOptions`').
    """
    options = BakeOptions(
        samples=samples,
        sample_tokens=sample_tokens,
        seed=seed,
        data=BOTH_DATA,
        questions=questions,
        answer_tokens=answer_tokens,
        question_prompt=question_prompt,
        question_temperature=question_temperature,
        topics=topics,
        cloze=cloze,
        cloze_form=cloze_form,
        cloze_teacher=cloze_teacher,
    )
    ctx = fit_context(model, tokenizer, context_ids, options, queries, chat, answer, prefix)
    return gather(ctx)


def check_rank(rank: int | None, model: torch.nn.Module, blocks) -> None:
    """Refuse a rank past every patched matrix's size (``BakeOptions`` refused one below 1).

    Raises:
        OptionError: naming ``rank``.
    """
    if rank is None:
        return
    largest = 0
    for block in blocks.blocks:
        for site in (*block.inner, block.outer):
            largest = max(largest, min(model.get_parameter(site.weight).shape[-2:]))
    if rank > largest:
        raise OptionError(
            "{rank} {} is past the matrix size: the largest rank is {}", rank, largest
        )


def bake(
    model: torch.nn.Module,
    tokenizer=None,
    context: str | None = None,
    queries: Sequence[str] | None = None,
    *,
    options: BakeOptions | None = None,
    context_ids: list[int] | None = None,
    data: FitData | None = None,
    targets: dict[str, BlockTargets] | None = None,
    teacher: list | None = None,
    on_stage: Callable[[str], None] | None = None,
    on_block: Callable[[int, int, str], None] | None = None,
    messages: Sequence[dict] | None = None,
    emit: Sequence[str] = (),
) -> BakeResult:
    """Bake ``context`` into one patch for every query; the model is left unmodified.

    Args:
        model: a causal LM (float32 advised: the patch is fitted in float32).
        tokenizer: its tokenizer (for text, the prefix and the query file).
        context: the context text; or ``context_ids``.
        queries: query texts to fit on (besides the ``options.samples`` sampled ones).
        options: :class:`BakeOptions`.
        context_ids: the context's ids instead of text.
        data: ready fit data (context, prefix, query ids) instead of the above.
        targets: :func:`~ctxc.bake.data.record_fit_targets` of ``data``, when already recorded
            (reused between ranks and methods; rows of a longer set's leading queries serve).
        teacher: :func:`~ctxc.bake.distill.teacher_top` of ``data``, likewise (``distill``).
        on_stage: progress callback with a stage name.
        on_block: progress callback ``(done, total, block)`` of the fit.
        messages: a chat model's context turns (``{"role", "content"}``) instead of
            ``context``: the queries are user turns after them, rendered by the chat template
            and answered (:mod:`ctxc.bake.chat`).
        emit: the artefacts the patch goes into: a LoRA kind's (linear pairs only) refuses,
            before the fit, a fit that would move norm scales
            (:func:`~ctxc.bake.serve.check_servable_blocks`), and pads every delta to one rank.

    Returns:
        the :class:`BakeResult`.

    Raises:
        CtxcError: bad input (empty context, nothing to fit, a bad rank, too long), a model
            whose blocks cannot be fitted, or a failed condition (with the block).
    """
    o = options or BakeOptions()
    stage = on_stage or (lambda _name: None)
    if Patch.is_applied(model):
        raise CtxcError("a patch is applied to this model: remove it before baking")
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    chat = _chat(tokenizer, messages, context, context_ids)
    if o.method == ADDITIVE_METHOD:
        raise OptionError("{method} additive bakes chunks: ctxc.bake.chunks.bake_chunks")
    # The blocks first (a cached trace): a model or a LoRA kind they refuse costs no fit data.
    traced, blocks = fit_blocks(model, o)
    check_servable_blocks(emit, o, blocks)
    clock = time.perf_counter()  # the data's own time, as before (the trace is not in it)
    if data is None:
        ids = chat.context_ids if chat else _context_ids(tokenizer, context, context_ids)
        data = fit_data(model, tokenizer, ids, queries, o, stage, chat)
    timings["data"] = round(time.perf_counter() - clock, 3)
    fit, extra = None, {}
    if o.method == FIT_METHOD or o.distill_from_fit:
        targets = _fit_targets(model, traced, blocks, data, targets, o, stage, timings)
        priors = _priors(model, blocks, data, o, stage, timings)
        stage("fitting")
        clock = time.perf_counter()
        fit = _fit(traced, blocks, targets, data, o, on_block, priors=priors)
        timings["fit"] = round(time.perf_counter() - clock, 3)
        if o.method == FIT_METHOD and o.on_policy_for(chat is not None):
            clock = time.perf_counter()
            data, targets, fit = _refit_on_policy(
                model, tokenizer, chat, traced, blocks, data, targets, fit, o, stage, on_block,
                priors,
            )  # fmt: skip
            timings["on_policy"] = round(time.perf_counter() - clock, 3)
    meta = patch_meta(model, traced.dtype, data, o)
    patch = Patch(fit.deltas, meta) if fit is not None else None
    if patch is not None and o.rank is not None and (o.linear_only or servable_kinds(emit)):
        patch = pad_to_rank(patch, o.rank)  # one rank for every module, as a LoRA has
    if o.method == DISTILL_METHOD:
        from ctxc.bake.distill import distill

        stage("distilling")
        clock = time.perf_counter()
        run = distill(model, blocks, data, o, meta, start=patch, teacher=teacher)
        timings["distill"] = round(time.perf_counter() - clock, 3)
        patch = run.patch
        extra["distill"] = {"rank": run.rank, "steps": run.steps, "seconds": run.seconds}
        extra["distill"]["last_loss"] = run.loss
    assert patch is not None
    if chat is not None:
        extra["chat"] = chat.to_dict()
    return BakeResult(patch, data, fit, {**_report(o, data, fit, timings), **extra}, chat)


def _chat(tokenizer, messages, context, context_ids) -> ChatFormat | None:
    """The :class:`~ctxc.bake.chat.ChatFormat` of ``messages`` (None without them)."""
    if messages is None:
        return None
    if context is not None or context_ids is not None:
        raise CtxcError("give messages or a context (text or ids), not both")
    if tokenizer is None:
        raise CtxcError("a tokenizer (with a chat template) is needed for messages")
    return chat_format(tokenizer, messages)


def _refit_on_policy(
    model,
    tokenizer,
    chat,
    traced,
    blocks,
    data: FitData,
    targets,
    fit: FitSolution,
    o: BakeOptions,
    stage,
    on_block,
    priors=None,
) -> tuple[FitData, dict[str, BlockTargets], FitSolution]:
    """The fit again over ``data`` and the patched model's own answers to its questions, read
    by the full-context model (:mod:`ctxc.bake.onpolicy`): (data, targets, fit)."""
    stage("on-policy rows: the patched model answers the fit's questions")
    n = len(data.queries)
    first = Patch(fit.deltas, patch_meta(model, traced.dtype, data, o))
    cut = chat.answer if chat is not None else (lambda a: a[: answer_end(tokenizer, a)])
    with shortlist_head(model):
        data = with_own_answers(model, data, first, o.answer_tokens, cut)
    if len(data.queries) == n:
        return data, targets, fit
    rows = data.part(0, n).positions  # targets may be a longer set's: its leading rows
    mine = cached_fit_targets(model, traced, blocks, data.part(n))
    if o.on_policy_refit == "new":
        # A refit pass over the new rows alone: their question positions repeat the first
        # fit's rows (the same tokens, the same targets), so only the answers are fitted.
        stage("fitting the on-policy answers")
        return (
            data,
            targets,
            _fit(traced, blocks, mine, data.part(n), o, on_block, fit, priors=priors),
        )
    targets = joined_targets({p: t.leading(rows) for p, t in targets.items()}, mine)
    stage("fitting again")
    fitted = None
    if o.on_policy_refit == "answers":  # the new rows' questions repeat the first rows: run only
        first_rows = query_rows(data.part(0, n), o.fit_prefix, o.fit_rows == "answers")
        fitted = torch.cat([first_rows, query_rows(data.part(n), o.fit_prefix, True)])
    return (
        data,
        targets,
        _fit(traced, blocks, targets, data, o, on_block, rows=fitted, priors=priors),
    )


def _fit(
    traced,
    blocks,
    targets,
    data: FitData,
    o: BakeOptions,
    on_block,
    on_top: FitSolution | None = None,
    rows: torch.Tensor | None = None,
    priors: dict[str, torch.Tensor] | None = None,
) -> FitSolution:
    """:func:`~ctxc.passes.solver.fit_solve.fit_solve` of ``data`` under ``o``; with ``on_top``,
    a refit pass on top of its deltas over ``data``'s answers (its question positions run, not
    fitted); ``rows`` [N] bool, the fitted positions instead of ``o``'s; ``priors`` the ridge's
    metrics (:func:`_priors`)."""
    queries = [torch.tensor([data.reduced(i)]) for i in range(len(data.queries))]
    opts = fit_options(o)
    answers = o.fit_rows == "answers" or on_top is not None
    whole = o.fit_prefix and not data.opening and not answers
    if rows is None:
        rows = None if whole else query_rows(data, o.fit_prefix, answers)
    weights = row_weights(data, o.off_topic_weight)
    start = None if on_top is None else on_top.deltas
    return fit_solve(
        traced,
        blocks,
        targets,
        queries,
        opts,
        on_block,
        rows,
        1 + o.refit_passes,
        weights,
        start,
        priors,
    )


def _fit_targets(model, traced, blocks, data: FitData, targets, o: BakeOptions, stage, timings):
    """The fit's targets: the full runs' (``targets`` when given, else recorded, timed into
    ``timings``), the off-topic rows' replaced by the model's own with
    ``o.off_topic_targets == "none"``."""
    if targets is None:
        clock = time.perf_counter()
        stage("full runs")
        targets = cached_fit_targets(model, traced, blocks, data)
        timings["targets"] = round(time.perf_counter() - clock, 3)
    if o.off_topic_targets == "none":  # given targets too: replacing twice changes nothing
        targets = own_targets(model, traced, blocks, data, targets, OFF_TOPIC_KINDS)
    return targets


def _priors(
    model, blocks, data: FitData, o: BakeOptions, stage, timings: dict[str, float]
) -> dict[str, torch.Tensor] | None:
    """The ridge's metric of every linear the fit moves (``o.prior``: :mod:`ctxc.bake.prior`),
    timed into ``timings``; None at ``o.prior == 0``."""
    if not o.prior:
        return None
    from ctxc.bake.prior import input_priors, moved_linears

    clock = time.perf_counter()
    stage("the prior: the model's own text")
    names = moved_linears(blocks, bool(fit_options(o).attention_moves))
    try:
        got = input_priors(model, data.prefix, names, o.prior, o.seed)
    except ValueError as exc:
        raise OptionError(f"{{prior}}: {exc}") from exc
    timings["prior"] = round(time.perf_counter() - clock, 3)
    return got


def fit_options(o: BakeOptions) -> FitOptions:
    """The solver's :class:`~ctxc.passes.solver.fit_moves.FitOptions` of a bake's ``o``."""
    return FitOptions(
        o.ridge,
        o.rank,
        o.scale_ridge,
        o.input_moves,
        o.rank_per_block,
        o.moves_attention,
        o.linear_only,
        o.moved_blocks,
    )


def row_weights(data: FitData, off_topic: float) -> torch.Tensor | None:
    """[N] each fit position's weight: ``off_topic`` at an off-topic row's positions
    (:data:`OFF_TOPIC_KINDS`), 1 elsewhere; None when every weight is 1."""
    if off_topic == 1.0 or not any(k in OFF_TOPIC_KINDS for k in data.kinds):
        return None
    n = len(data.prefix)
    return torch.cat(
        [
            torch.full((n + len(q),), off_topic if k in OFF_TOPIC_KINDS else 1.0)
            for q, k in zip(data.queries, data.kinds, strict=True)
        ]
    )


def fit_data(
    model, tokenizer, ids: list[int], queries, o: BakeOptions, stage, chat=None
) -> FitData:
    """The fit data of ``o``: every source's rows (:func:`~ctxc.bake.sources.loop.gather`,
    its counts on the stage line), refused in one line when there is nothing to fit on; with
    ``chat``, in its turns, the query file's turns answered."""
    o.check_fit(queries)
    # The sampling loops' head in bfloat16 where asked (BakeOptions.sample_head); greedy loops'
    # always (compiler/bake/selfstudy.py).
    head = shortlist_head(model) if o.sample_head == "bfloat16" else contextlib.nullcontext()
    with head:
        data = gather(fit_context(model, tokenizer, ids, o, queries, chat, answer=True), stage)
    if not data.queries:
        cloze = " and the context has no name or number to ask about ({cloze})" if o.clozed else ""
        raise OptionError(
            "the model wrote no self-study question about this context (none ended in '?')"
            + cloze
            + ": fit with {data} both or continuations, or give {queries}"
        )
    return data


def fit_blocks(model: torch.nn.Module, o: BakeOptions):
    """The traced model and its blocks, refused in one line when bake cannot fit them."""
    traced, blocks = traced_blocks(model)
    if traced.frontend == "static":
        raise CtxcError("bake needs one export for every query length; this model has none")
    if not blocks.blocks or blocks.rejections:
        raise UnpatchableError(
            "bake needs every block patchable: " + "; ".join(str(r) for r in blocks.rejections)
            if blocks.rejections
            else "no MLP block found"
        )
    check_rank(o.rank, model, blocks)
    if o.attention is True and not any(b.attention is not None for b in blocks.blocks):
        raise OptionError(
            "{attention}: no block of this model has an attention output projection behind a "
            "post norm (sandwich norms: Gemma 2/3, OLMo 2)"
        )
    return traced, blocks


def query_rows(data: FitData, fit_prefix: bool = False, answers: bool = False) -> torch.Tensor:
    """[N] bool: True at the query tokens' positions (and, with ``fit_prefix``, the prefix's
    matched ones), False at the other prefix positions; with ``answers``, a query's positions
    before the one that predicts its answer's first token are False too
    (``FitData.answer_from``)."""
    n = len(data.prefix)
    skip = n - data.head if fit_prefix else n
    starts = data.answer_from if answers and data.answer_from else [0] * len(data.queries)
    return torch.cat(
        [
            torch.arange(n + len(q)) >= max(skip, n + a - 1 if a else 0)
            for q, a in zip(data.queries, starts, strict=True)
        ]
    )


def _context_ids(tokenizer, context: str | None, context_ids: list[int] | None) -> list[int]:
    if context_ids is not None:
        if not context_ids:
            raise CtxcError("the context is empty")
        return [int(i) for i in context_ids]
    if context is None or not context.strip():
        raise CtxcError("the context is empty")
    if tokenizer is None:
        raise CtxcError("a tokenizer is needed for text input")
    return list(tokenizer(context).input_ids)


def patch_meta(model, dtype: torch.dtype, data: FitData, o: BakeOptions) -> PatchMeta:
    return PatchMeta(
        fingerprint=fingerprint(model),
        context_ids=data.context_ids,
        query_ids=data.queries[0],
        update=f"bake-{o.method}",
        dtype=str(dtype).removeprefix("torch."),
        ctxc_version=__version__,
        model=str(getattr(model, "ctxc_name", getattr(model, "name_or_path", ""))),
    )


def _report(o: BakeOptions, data: FitData, fit: FitSolution | None, timings: dict) -> dict:
    return {
        "options": asdict(o),
        "context_tokens": len(data.context_ids),
        "fit_queries": len(data.queries),
        "fit_positions": data.positions,
        "fit_kinds": {k: data.kinds.count(k) for k in sorted(set(data.kinds))},
        "blocks": [asdict(b) for b in fit.blocks] if fit is not None else [],
        "timings": timings,
        "ctxc_version": __version__,
    }
