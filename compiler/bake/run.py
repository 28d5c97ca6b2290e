"""The bake's run: a request checked, the model loaded once, the patch made and its folder
written (``ctxc bake``, and a library caller's).

:func:`bake_into` bakes one context (plain text or chat turns) into a folder;
:func:`bake_additive` bakes chunks whose statistics add (``method="additive"``) and
:func:`change_additive` adds a chunk to, or removes one from, such a folder in place. Routed
bakes (one patch per chunk and a router) are :mod:`ctxc.bake.routed`. Each checks what the
request, the tokenizer and the files decide before the model loads (:func:`preflight`), writes
through ``ctxc.store.output.output_folder`` (staged, placed whole: nothing half written), and
returns a :class:`BakeRun`: the folder, its report (the figures and each artefact's check) and
the summary lines. It prints nothing: progress goes to the :class:`~ctxc.bake.hooks.BakeHooks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from ctxc.bake.hooks import BakeHooks
from ctxc.bake.job import BakeJob, BakeRun, HeldOut
from ctxc.bake.route import chunk_turns
from ctxc.bake.scope import SCOPE_FILE, Scope
from ctxc.core.errors import CtxcError
from ctxc.core.options import BakeOptions
from ctxc.core.vocabulary import ADDITIVE_METHOD
from ctxc.store.output import output_folder

__all__ = [
    "bake_additive",
    "bake_into",
    "change_additive",
    "preflight",
]

# The user turn a chat context is split with before the model loads (any would do: the
# context's ids are the same for every one).
_PROBE = "What is it about?"


def preflight(job: BakeJob, hooks: BakeHooks | None = None, *, chat_chunks: bool = False) -> None:
    """Refuse, before any model loads, what the request, the tokenizer and the files decide:
    nothing to fit on, an empty context, a context past the model's positions, chat turns
    without a template or that it cannot split. Reads the tokenizer and the config alone (a
    second or two; the bundled model's first run converts it first, once).

    Args:
        job: the request.
        hooks: the stage's reporters; None: silent.
        chat_chunks: each of ``job.chunks`` is the one system turn of its own chat context
            (a routed chat bake: :func:`~ctxc.bake.route.chunk_turns`), each checked as
            ``job.messages`` is.

    Raises:
        CtxcError: the first problem, in one line.
    """
    on_stage = (hooks or BakeHooks()).on_stage
    # What the request alone decides comes first: no torch import, nothing read.
    job.options.check_fit(job.queries)
    texts = [job.context] if job.context is not None else [t for _, t in job.chunks]
    if job.messages is None and not texts:
        raise CtxcError("no context to bake")
    if any(not text.strip() for text in texts):
        raise CtxcError("the context is empty")
    # Then what the tokenizer and the config decide (no weights read).
    from ctxc.core.chat import NO_TEMPLATE, split_chat
    from ctxc.models.load import (
        declares_chat_template,
        load_tokenizer,
        model_directory,
        positions_of,
    )

    on_stage(f"reading the tokenizer of {job.model or 'the bundled model'}")
    directory = model_directory(job.model, on_stage)
    chat = job.messages is not None or chat_chunks
    if chat and not declares_chat_template(directory):
        raise CtxcError(NO_TEMPLATE)
    tokenizer = load_tokenizer(job.model, on_stage)
    if job.messages is not None:
        # The context turns' ids are the same whatever user turn follows them.
        ids = split_chat(tokenizer, list(job.messages), _PROBE).context_ids
        lengths = [len(ids)]
    elif chat_chunks:
        lengths = [len(split_chat(tokenizer, chunk_turns(t), _PROBE).context_ids) for t in texts]
    else:
        lengths = [len(tokenizer(text).input_ids) for text in texts]
    limit = positions_of(directory)
    if limit is not None and max(lengths) + 1 > limit[0]:  # the context and a query token
        raise CtxcError(
            f"the context is {max(lengths)} tokens; the model takes at most {limit[0]} "
            f"positions ({limit[1]}), a query's included"
        )


def bake_into(job: BakeJob, hooks: BakeHooks | None = None) -> BakeRun:
    """Bake ``job``'s context (text or chat turns) into one patch and write its folder.

    Returns:
        the :class:`BakeRun`.

    Raises:
        CtxcError: bad input (refused before the load), a model whose blocks cannot be
            fitted, a failed artefact check (no folder placed).

    Side effects:
        writes ``job.out`` (staged, placed when complete).
    """
    hooks = hooks or BakeHooks()
    if job.options.method == ADDITIVE_METHOD:
        raise CtxcError("an additive bake takes chunks: ctxc.bake.run.bake_additive")
    preflight(job, hooks)
    # The fit's modules import torch: after the refusals.
    from ctxc.bake.driver import bake
    from ctxc.bake.folder import summary_lines, write_bake

    with output_folder(job.out, job.force, "bake") as tmp:
        net, tokenizer = hooks.load(job.model, "float32")
        with hooks.progress("baking", "fitting") as (on_stage, on_block):
            result = bake(
                net,
                tokenizer,
                job.context,
                list(job.queries) if job.queries is not None else None,
                options=job.options,
                messages=list(job.messages) if job.messages is not None else None,
                on_stage=on_stage,
                on_block=on_block,
                emit=job.emit,
            )
        report = write_bake(net, tokenizer, result, tmp, job.emit, job.held, hooks)
    return BakeRun(Path(job.out), report, summary_lines(report["figures"]))


def bake_additive(job: BakeJob, hooks: BakeHooks | None = None) -> BakeRun:
    """Bake ``job.chunks`` as one additive patch (``method="additive"``): each chunk's
    statistics summed, the patch solved from the sums; the folder keeps the statistics
    (``--add``/``--remove`` change it in place: :func:`change_additive`).

    Raises:
        CtxcError: no chunk, chat turns, options that are not additive.

    Side effects:
        writes ``job.out``.
    """
    hooks = hooks or BakeHooks()
    if job.messages is not None:
        raise CtxcError("an additive bake takes context chunks, not chat turns")
    if not job.chunks:
        raise CtxcError("an additive bake needs at least one context chunk")
    preflight(job, hooks)
    from ctxc.bake.chunks import bake_chunks

    with output_folder(job.out, job.force, "bake") as tmp:
        net, tokenizer = hooks.load(job.model, "float32")
        contexts = [(name, list(tokenizer(text).input_ids)) for name, text in job.chunks]
        with hooks.progress("gathering", "statistics") as (on_stage, on_block):
            got = bake_chunks(
                net,
                tokenizer,
                contexts,
                list(job.queries) if job.queries is not None else None,
                options=job.options,
                on_stage=on_stage,
                on_block=on_block,
            )
        gate = Scope.of("\n\n".join(text for _, text in job.chunks))
        report, lines = _write_chunks(net, tokenizer, got, tmp, job.emit, job.held, hooks, gate)
    return BakeRun(Path(job.out), report, lines)


def change_additive(
    folder: Path,
    chunks: Sequence[tuple[str, str]] = (),
    remove: str | None = None,
    queries: Sequence[str] | None = None,
    held=None,
    emit: Sequence[str] = (),
    model: str | None = None,
    hooks: BakeHooks | None = None,
) -> BakeRun:
    """Add ``chunks`` to, or ``remove`` one chunk (its id or name) from, the additive bake in
    ``folder``: its statistics with a chunk more or less, the patch solved again from them.

    Args:
        folder: an additive bake folder (it holds ``stats.safetensors``).
        chunks: ``(name, text)`` of the chunks to add (fitted with the folder's options).
        remove: the chunk to drop instead.
        queries: fit query texts of the new chunks.
        held: the :class:`~ctxc.bake.folder.HeldOut` sets of the figures (on the last chunk
            added; none after a removal).
        emit: the artefacts the folder gets.
        model: the model the folder was baked on.

    Raises:
        CtxcError: not an additive folder, no such chunk, both or neither of ``chunks`` and
            ``remove``, another model.

    Side effects:
        replaces ``folder`` once all of it is written.
    """
    from ctxc.bake.chunks import bake_chunks, find_chunk, remove_chunk
    from ctxc.bake.statistics import STATS_FILE, Statistics
    from ctxc.patch import Patch

    hooks = hooks or BakeHooks()
    if bool(chunks) == (remove is not None):
        raise CtxcError("give the chunks to add or the chunk to remove (one of them)")
    stats = Statistics.load(Path(folder) / STATS_FILE)
    if remove is not None:
        find_chunk(stats, remove)  # one line before the model loads
    else:
        options = BakeOptions(**stats.options)
        asked = BakeJob(Path(folder), chunks=tuple(chunks), queries=_tuple(queries))
        preflight(replace(asked, options=options, model=model), hooks)
    with output_folder(Path(folder), True, "bake") as tmp:
        before = Patch.load(folder)
        net, tokenizer = hooks.load(model, before.meta.dtype)
        before.check(net)
        with hooks.progress("gathering", "statistics") as (on_stage, on_block):
            if remove is not None:
                got = remove_chunk(net, stats, remove, on_stage=on_stage, on_block=on_block)
            else:
                contexts = [(name, list(tokenizer(text).input_ids)) for name, text in chunks]
                got = bake_chunks(
                    net,
                    tokenizer,
                    contexts,
                    list(queries) if queries is not None else None,
                    start=stats,
                    on_stage=on_stage,
                    on_block=on_block,
                )
        held = held if held is not None else HeldOut()
        # The patch answers every chunk kept: the scope gains a new chunk's words; a removed
        # chunk's words stay (a word may be another chunk's too): it admits at least as much.
        gate = Scope.load(folder) if (Path(folder) / SCOPE_FILE).is_file() else None
        for _, text in chunks:
            gate = Scope.of(text) if gate is None else gate.union(Scope.of(text))
        if gate is None:  # a folder baked before scopes, a chunk removed: none to keep
            gate = Scope(frozenset(), 0.0)
        report, lines = _write_chunks(net, tokenizer, got, tmp, emit, held, hooks, gate)
    return BakeRun(Path(folder), report, lines)


def _tuple(items: Sequence[str] | None) -> tuple[str, ...] | None:
    return tuple(items) if items is not None else None


def _write_chunks(net, tokenizer, got, tmp: Path, emit, held, hooks: BakeHooks, gate: Scope):
    """Write an additive bake's patch, statistics, scope (``gate``: every chunk's words),
    artefacts and report: (the report, its summary lines). The figures are the last chunk
    gathered's (served with the whole scope); none after a removal."""
    from ctxc.bake.driver import BakeResult
    from ctxc.bake.folder import emit_baked, measure_figures, save_scope, summary_lines
    from ctxc.bake.statistics import STATS_FILE
    from ctxc.core.report import write_report
    from ctxc.core.vocabulary import PATCH_FILE

    report = got.report
    held_chunks = ", ".join(f"{c['id']} ({c['name']})" for c in report["chunks"])
    lines = [f"chunks: {held_chunks}"]
    if got.data is not None:
        result = BakeResult(got.patch, got.data, None, report)
        seed = int(report["options"]["seed"])
        report["figures"] = measure_figures(
            net, tokenizer, result, held, seed, hooks.on_stage, scope=gate
        )
        report["figures_chunk"] = report["chunks"][-1]["id"]
        lines += summary_lines(report["figures"])
    save_scope(tmp, report, gate)
    got.patch.save(tmp / PATCH_FILE)
    got.stats.save(tmp / STATS_FILE)
    artefacts = emit_baked(net, tokenizer, got.patch, tmp, emit, report, hooks)
    return write_report(tmp, report, artefacts, under="artefacts"), lines
