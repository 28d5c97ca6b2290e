"""The driver: context -> Patch + report, through trace, locate, record, solve, verify."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import astuple, dataclass

import torch

from ctxc._version import __version__
from ctxc.core.chat import ChatSplit
from ctxc.core.errors import (
    CtxcError,
    OptionError,
    SolveError,
    UnpatchableError,
    UntraceableError,
)
from ctxc.core.metrics import Fidelity, fidelity
from ctxc.core.options import CompileOptions
from ctxc.core.report import CompileReport, reference_name
from ctxc.core.tokens import split_tokens
from ctxc.core.vocabulary import DEFAULT_RULE
from ctxc.frontend.trace import TracedModel
from ctxc.models.devices import check_on_device, describe
from ctxc.models.fingerprint import fingerprint
from ctxc.models.images import ImageContext
from ctxc.models.load import check_length
from ctxc.models.offload import input_device
from ctxc.passes.locate.block_map import BlockMap, Rejection
from ctxc.passes.runtime.run_graph import run_logits
from ctxc.passes.solver.solve import solve
from ctxc.patch import Patch, PatchMeta
from ctxc.runs.image_run import image_figures, multimodal_full_graph
from ctxc.runs.patched_forward import patched_logits
from ctxc.runs.plain_attention import check_runtime_gap, plain_attention
from ctxc.runs.reference_run import full_run
from ctxc.store.traced import traced_blocks

__all__ = ["CompileResult", "compile"]


@dataclass(frozen=True)
class CompileResult:
    """What :func:`compile` returns: the patch, its report, and the full-context logits.

    Attributes:
        full_logits: the model fed context + query, at the query positions [k, vocab], float32,
            as its own default forward computes them (every position's logits, the runtime's
            attention): the reference every figure is measured against, without a second pass.
        patched_logits: the verification's run, ``model`` with the patch's weights (eager, in
            memory) fed the query [k, vocab], float32; None without ``verify`` or for a model
            verified through its graph (dispersed). The PEFT check's torch reference.
    """

    patch: Patch
    report: CompileReport
    full_logits: torch.Tensor | None = None
    patched_logits: torch.Tensor | None = None


def _matching_runs(model: torch.nn.Module, n: int, k: int) -> tuple:
    """The exports and block maps for the full run (``n`` tokens) and the reduced run (``k``).

    Static exports are separate graphs: their blocks correspond by path (the full run's targets
    are keyed by it), so both maps must list the same blocks, in order, with the same kinds.
    """
    full = traced_blocks(model, n)
    reduced = traced_blocks(model, k)
    if full is not reduced:
        a = [(b.path, b.output_control, len(b.inner)) for b in full[1].blocks]
        b = [(b.path, b.output_control, len(b.inner)) for b in reduced[1].blocks]
        if a != b:
            raise CtxcError(
                f"the static exports for {n} and {k} tokens find different blocks "
                f"({len(a)}: {a[:2]}... vs {len(b)}: {b[:2]}...): no correspondence"
            )
    # The report names the ladder's latest rung that either run needed
    # (compiler/frontend/ladder.py).
    rungs = ("dynamic", "bounded", "static", "specialised")
    frontend = max(full[0].frontend, reduced[0].frontend, key=rungs.index)
    return full, reduced, frontend


def compile(
    model: torch.nn.Module,
    tokenizer=None,
    context: str | None = None,
    query: str | None = None,
    *,
    context_ids: list[int] | None = None,
    query_ids: list[int] | None = None,
    images: list | None = None,
    messages: list[dict] | None = None,
    update: str = DEFAULT_RULE,
    start_layer: int = 0,
    skip_unpatchable: bool = False,
    verify: bool = True,
    apply: str = "baked",
    on_stage: Callable[[str], None] | None = None,
    on_block: Callable[[int, int, str], None] | None = None,
    device: str | None = None,
    options: CompileOptions | None = None,
) -> CompileResult:
    """Compile a context into a :class:`Patch` for ``model``; the model is left unmodified.

    Args:
        model: a causal LM (Transformers, or any module whose forward returns ``.logits``).
        tokenizer: needed when ``context``/``query`` are text.
        context: the context text; or pass ``context_ids``.
        query: the query text; default: the context's last token.
        context_ids, query_ids: token ids instead of text.
        images: image paths or PIL images, for a vision-language model: the context is the
            processor's layout of the images and ``context`` (``compiler/models/images.py``); then
            ``tokenizer`` may be the model's processor (else it is loaded from the model's
            folder). The patch changes the language model's blocks only.
        messages: a chat conversation instead of ``context`` (``[{"role", "content"}, ...]``;
            with ``images``, a content may list ``{"type": "image"}`` parts, in their order):
            the context is every turn before the query, the query ``query`` as the next user
            message (else the last message, a user turn), both rendered by the tokenizer's chat
            template with its generation prompt and split where the template puts a boundary
            (``compiler/core/chat.py``, docs/chat.md); ``report.chat`` holds the rendered query.
        update: ``stable`` (default), ``standard``, ``output``, ``lora`` (core/vocabulary.py).
        start_layer: blocks with index below it stay unpatched.
        skip_unpatchable: patch the patchable blocks when others are rejected (else an error).
        verify: run the model with the patch applied on the query, for ``report.emitted``.
        apply: ``baked`` (default: the patched weights in the model's dtype, as the torch backend
            writes them; each block's rounding is absorbed by the next, since the solver bakes
            block by block) or ``lowrank`` (deltas as actions beside the weights, in memory
            only: ``report.emitted`` then still measures the baked weights).
        on_stage: progress callback, called with a stage name.
        on_block: progress callback ``(done, total, block path)`` from the solver.
        device: the device to run on (``cpu``, ``cuda``, ``cuda:N``, ``mps``): the model must be
            there (``ctxc.load_model(..., device=...)``); default: where the model is. A model
            dispersed by accelerate (``device_map``) runs where each block lives.
        options: a :class:`~ctxc.core.options.CompileOptions` (already validated) instead of
            ``update``, ``start_layer``, ``skip_unpatchable`` and ``apply``.

    Returns:
        the :class:`CompileResult`.

    Raises:
        CtxcError: bad input, rejected blocks, or a failed condition (see its message); an
            :class:`~ctxc.core.errors.OptionError` names the bad parameter.
    """
    options = _options(options, (update, start_layer, skip_unpatchable, apply))
    if Patch.is_applied(model):
        raise CtxcError("a patch is applied to this model: remove it before compiling")
    if device is not None:
        check_on_device(model, device)
    ctx_ids, q_ids, image, chat = _inputs(
        model, tokenizer, (context, query, context_ids, query_ids), images, messages
    )
    check_length(model, len(ctx_ids) + len(q_ids))  # before the trace: no model run is wasted
    try:
        run = _Run(options, verify, on_stage, on_block, image, chat)
        return _compile_ids(model, ctx_ids, q_ids, run)
    except RuntimeError as exc:  # a runtime assertion of a specialised export (frontend.py)
        if "Runtime assertion failed" not in str(exc):
            raise
        raise UntraceableError(
            "the forward pass branches on tensor values: the specialised export decided a "
            f"branch by its example's values and these ids take another ({str(exc)[:160]})"
        ) from exc


def _options(options: CompileOptions | None, given: tuple) -> CompileOptions:
    """``options``, or the keyword arguments ``given`` made into one (validated, once)."""
    if options is None:
        return CompileOptions(*given)
    if given != astuple(CompileOptions()):
        raise CtxcError("give options or update/start_layer/skip_unpatchable/apply, not both")
    return options


@dataclass(frozen=True)
class _Run:
    """One :func:`compile`: its validated options, progress hooks and image context."""

    options: CompileOptions
    verify: bool
    on_stage: Callable[[str], None] | None
    on_block: Callable[[int, int, str], None] | None
    image: ImageContext | None = None
    chat: ChatSplit | None = None


def _inputs(model, tokenizer, given: tuple, images, messages) -> tuple:
    """(context ids, query ids, the image context or None, the chat split or None) of
    :func:`compile`'s inputs; ``given``: (context, query, context_ids, query_ids)."""
    context, query, context_ids, query_ids = given
    if messages is not None and images is None:
        chat = _chat_split(tokenizer, messages, query, (context, context_ids, query_ids), None)
        return chat.context_ids, chat.query_ids, None, chat
    if images is not None:
        from ctxc.models.images import chat_image_context, encode_image_context, read_images
        from ctxc.models.vlm import load_processor

        processor = tokenizer if hasattr(tokenizer, "image_processor") else load_processor(model)
        if messages is not None:  # the images of the messages' image parts, in order
            given_images = read_images(images)
            others = (context, context_ids, query_ids)
            chat = _chat_split(processor, messages, query, others, given_images)
            image = chat_image_context(model, processor, chat, images)
            return chat.context_ids, chat.query_ids, image, chat
        image = encode_image_context(model, processor, context, images, query)
        return image.context_ids, image.query_ids, image, None
    return (*_ids(tokenizer, context, query, context_ids, query_ids), None, None)


def _chat_split(tokenizer, messages, query: str | None, others: tuple, images) -> ChatSplit:
    """The chat template's split of ``messages`` (+ ``query``), with ``images`` (PIL, for the
    messages' image parts) or None; ``others``: the other inputs (context, context_ids,
    query_ids), which must be None."""
    from ctxc.core.chat import chat_messages, split_chat

    if any(x is not None for x in others):
        raise CtxcError("give messages or a context (text or ids), not both")
    if tokenizer is None:
        raise CtxcError("a tokenizer (with a chat template) is needed for messages")
    turns, text = chat_messages(messages=messages, query=query)
    return split_chat(tokenizer, turns, text, images)


def _compile_ids(
    model: torch.nn.Module, ctx_ids: list[int], q_ids: list[int], o: _Run
) -> CompileResult:
    """:func:`compile` on checked token ids: trace, control, full run, solve, verify, report."""
    stage, opt = o.on_stage or (lambda _name: None), o.options
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 4)
        clock = now

    stage("tracing")
    full_traced, full_blocks, traced, blocks, frontend, image_run = _traces(
        model, ctx_ids, q_ids, o
    )
    lap("trace")
    _check_blocks(blocks, opt.skip_unpatchable, opt.start_layer)
    device = input_device(model)  # the embedding's device (a dispersed model's too)
    full_ids = torch.tensor([ctx_ids + q_ids], dtype=torch.long, device=device)
    query = full_ids[:, len(ctx_ids) :]  # [1, k]

    # The control: the model's own forward on the query, as the user's runtime computes it.
    # A compile verified in the runtime with baked weights compares the graph with the runtime
    # on its patched runs (the solver's and the verification's), not on a graph run of its own.
    deferred = o.verify and traced.source is None and opt.apply == "baked"
    attention = plain_attention(model, traced, query, deferred)
    lap("control_run")
    stage("full run")
    full, reference = full_run(
        model, full_traced, full_blocks, full_ids, len(q_ids), image_run, attention
    )
    assert full.reference is not None  # full_run records it (reference=True)
    lap("full_run")
    stage("solving")
    solution, failed = _solve_skipping((traced, blocks, full, query), o, attention.query_ops)
    lap("solve")
    rejections = tuple(str(r) for r in (*blocks.rejections, *failed))
    if not solution.deltas:  # e.g. skip_unpatchable with every block failing: never a no-op
        where = (
            f": {'; '.join(rejections)}" if rejections else f" from start layer {opt.start_layer}"
        )
        raise UnpatchableError("no block was patched" + where)

    solver = fidelity(solution.logits, full.logits)
    meta = _meta(model, traced, ctx_ids, q_ids, opt.update, opt.start_layer, solver)
    patch = Patch(solution.deltas, meta)
    lap("fingerprint")
    emitted, eager = solution.logits, None
    if o.verify:
        stage("verifying")
        emitted = _run_patched(model, patch, query, traced)
        eager = emitted if traced.source is None else None  # _run_patched: patched_logits
        if attention.graph_vs_runtime is None:  # deferred: the same weights in both runs
            check_runtime_gap(solution.logits, emitted, traced.dtype, " with the patch's weights")
        lap("verify")
    report = CompileReport(
        model=meta.model,
        dtype=meta.dtype,
        update=opt.update,
        start_layer=opt.start_layer,
        context_ids=ctx_ids,
        query_ids=q_ids,
        patched=solver,
        emitted=fidelity(emitted, reference),
        control=fidelity(attention.control, reference),
        blocks=solution.stats,
        rejections=rejections,
        timings=timings,
        ctxc_version=__version__,
        apply=opt.apply,
        frontend=frontend,
        images=None if o.image is None else image_figures(o.image, image_run, full.reference),
        device=str(device),
        placement=describe(model)[1],
        floor=fidelity(full.logits, reference),
        reference=reference_name(model, o.image is not None),
        chat=None if o.chat is None else o.chat.to_dict(),
    )
    return CompileResult(patch, report, full_logits=reference, patched_logits=eager)


def _traces(model: torch.nn.Module, ctx_ids: list[int], q_ids: list[int], o: _Run) -> tuple:
    """The full run's and the reduced run's graphs and block maps, the frontend's rung, and
    for an image context its :class:`MultimodalRun` (else None)."""
    if o.image is None:
        (full_traced, full_blocks), (traced, blocks), frontend = _matching_runs(
            model, len(ctx_ids) + len(q_ids), len(q_ids)
        )
        return full_traced, full_blocks, traced, blocks, frontend, None
    # The images enter through the model's own forward (compiler/runs/image_run.py).
    traced, blocks = traced_blocks(model, len(q_ids))
    _check_blocks(blocks, o.options.skip_unpatchable, o.options.start_layer)
    run = multimodal_full_graph(model, blocks, o.image.inputs, len(q_ids))
    return run.traced, run.blocks, traced, blocks, traced.frontend, run


def _check_blocks(blocks: BlockMap, skip_unpatchable: bool, start_layer: int) -> None:
    """Refuse a model with no block, rejected blocks (unless skipped) or a bad start layer."""
    if not blocks.blocks:
        raise UnpatchableError("no residual MLP block found in this model" + _reasons(blocks))
    if blocks.rejections and not skip_unpatchable:
        raise UnpatchableError().naming(
            "{} block(s) admit no exact patch{} ({skip_unpatchable} patches the rest)",
            len(blocks.rejections),
            _reasons(blocks),
        )
    if start_layer >= len(blocks.blocks):  # CompileOptions: at least 0
        raise OptionError("{start_layer} {} is outside 0..{}", start_layer, len(blocks.blocks) - 1)


def _meta(
    model, traced: TracedModel, ctx_ids, q_ids, update: str, start_layer: int, solver: Fidelity
) -> PatchMeta:
    """The patch's metadata: what it was computed on and from, and the solver's figure (an
    artefact exported later is held to it: ``ctxc.core.checks.gate``)."""
    return PatchMeta(
        fingerprint=fingerprint(model),
        context_ids=ctx_ids,
        query_ids=q_ids,
        update=update,
        dtype=str(traced.dtype).removeprefix("torch."),
        ctxc_version=__version__,
        model=str(getattr(model, "ctxc_name", getattr(model, "name_or_path", ""))),
        start_layer=start_layer,
        solver_max_abs_logit_diff=solver.max_abs_logit_diff,
    )


def _solve_skipping(runs: tuple, o: _Run, ops: dict | None = None) -> tuple:
    """Solve; with ``skip_unpatchable``, leave a block whose condition fails unpatched and solve
    again (the blocks above it absorb its difference), until no block fails.

    Args:
        runs: ``(traced, blocks, full run, query ids)``.
        o: the compile's options and its ``on_block`` hook.
        ops: the reduced run's attention calls as the runtime makes them
            (``compiler/runs/plain_attention.py``).
    """
    opt = o.options
    traced, blocks, full, query = runs
    failed: list[Rejection] = []
    while True:
        skip = {r.where: r.reason for r in failed}
        try:
            solution = solve(
                traced,
                blocks,
                full,
                query,
                opt.update,
                opt.start_layer,
                o.on_block,
                opt.apply,
                skip=skip,
                ops=ops,
            )
            return solution, tuple(failed)
        except SolveError as exc:
            if not opt.skip_unpatchable or exc.block in skip:
                hint = "block {}: {} ({skip_unpatchable} patches the other blocks)"
                raise SolveError(exc.block, exc.reason).naming(hint, exc.block, exc.reason) from exc
            failed.append(Rejection(exc.block, exc.reason))


def _run_patched(
    model: torch.nn.Module, patch: Patch, query: torch.Tensor, traced: TracedModel
) -> torch.Tensor:
    """Logits [k, vocab] of ``model`` with ``patch`` applied, on ``query``; model restored.

    A dispersed model runs through its graph, which reads each patched weight from where
    ``Patch.apply`` wrote it, one block at a time: accelerate's own forward would read a whole
    offloaded module at once (Gemma 3's 670 MB embedding, for the head).
    """
    if traced.source is None:  # in memory: one module's patched weights at a time
        return patched_logits(model, patch, query)
    with patch.applied(model, check=False), torch.no_grad():
        return run_logits(traced, query)


def _ids(tokenizer, context, query, context_ids, query_ids) -> tuple[list[int], list[int]]:
    if context_ids is not None:
        ctx = [int(i) for i in context_ids]
        if query_ids is None:
            if len(ctx) < 2:
                raise CtxcError("the context has a single token: nothing is left to compile")
            return ctx[:-1], ctx[-1:]
        q = [int(i) for i in query_ids]
        if not q:
            raise CtxcError("the query is empty")
        return ctx, q
    if context is None:
        raise CtxcError("give a context (text or context_ids)")
    if tokenizer is None:
        raise CtxcError("a tokenizer is needed for text input")
    return split_tokens(tokenizer, context, query)


def _reasons(blocks: BlockMap) -> str:
    if not blocks.rejections:
        return ""
    return ": " + "; ".join(str(r) for r in blocks.rejections)
