"""A routed bake's run: a long document cut into chunks of paragraphs, each baked alone into
its own folder, a router beside them (issue 36; the router itself: :mod:`ctxc.bake.route`).

:func:`bake_routed` writes ``DIR/chunks/<id>/`` (an ordinary bake folder: ``patch.safetensors``,
``report.json``, the ``emit`` artefacts) per chunk and ``DIR/router.json``;
:func:`change_routed` bakes new chunks with DIR's options and artefacts beside the others, or
drops one; neither touches another chunk's patch. Prints nothing: the
:class:`~ctxc.bake.hooks.BakeHooks` hear of each chunk.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from ctxc.bake.hooks import BakeHooks
from ctxc.bake.job import BakeJob, BakeRun, HeldOut
from ctxc.bake.route import ROUTER_FILE, Router, split_chunks
from ctxc.core.errors import CtxcError
from ctxc.core.options import BakeOptions
from ctxc.core.vocabulary import ADDITIVE_METHOD
from ctxc.store.output import output_folder

__all__ = ["CHUNKS_DIR", "bake_routed", "change_routed", "is_routed", "routed_chunks"]

CHUNKS_DIR = "chunks"


def is_routed(folder: Path) -> bool:
    """Whether ``folder`` is a routed bake (it holds a router)."""
    return (Path(folder) / ROUTER_FILE).is_file()


def routed_chunks(documents: Sequence[tuple[str, str]], chunk_words: int) -> list[tuple[str, str]]:
    """``(document name, chunk text)`` of every document's chunks, in order
    (:func:`~ctxc.bake.route.split_chunks`; no model needed).

    Raises:
        CtxcError: no document.
    """
    if not documents:
        raise CtxcError("a routed bake cuts a document into chunks: give one")
    return [(name, c) for name, text in documents for c in split_chunks(text, chunk_words)]


def bake_routed(job: BakeJob, chunk_words: int, hooks: BakeHooks | None = None) -> BakeRun:
    """Every chunk of ``job.chunks`` (whole documents, cut at blank lines into chunks of at
    most ``chunk_words`` words) baked alone with ``job.options``, the router beside them.

    Returns:
        the :class:`BakeRun`: its report holds each chunk baked's report under ``chunks`` (by
        id) and every chunk's id under ``chunk_ids``.

    Raises:
        CtxcError: additive options, chat turns or fit queries (each chunk fits on its own
            data), an empty document, a context past the model's positions.

    Side effects:
        writes ``job.out`` (staged, placed when every chunk is baked).
    """
    from ctxc.bake.run import preflight

    hooks = hooks or BakeHooks()
    if job.options.method == ADDITIVE_METHOD:
        raise CtxcError("a routed bake bakes each chunk alone: give method fit or distill")
    if job.messages is not None or job.queries is not None:
        raise CtxcError("a routed bake fits each chunk on its own data (no chat turns, no queries)")
    chunks = routed_chunks(job.chunks, chunk_words)
    preflight(dataclasses.replace(job, chunks=tuple(chunks)), hooks)
    with output_folder(job.out, job.force, "bake") as tmp:
        net, tokenizer = hooks.load(job.model, "float32")
        options = dataclasses.asdict(job.options)
        router = Router((), (), options, chunk_words, tuple(job.emit))
        ids = router.next_ids(len(chunks))
        reports, lines = _bake_chunks(net, tokenizer, chunks, ids, job, tmp, hooks)
        router.added(ids, [t for _, t in chunks]).save(tmp)
    return BakeRun(Path(job.out), {"chunks": reports, "chunk_ids": ids}, lines)


def change_routed(
    folder: Path,
    documents: Sequence[tuple[str, str]] = (),
    remove: str | None = None,
    held: HeldOut | None = None,
    model: str | None = None,
    hooks: BakeHooks | None = None,
) -> BakeRun:
    """Add ``documents``' chunks to, or ``remove`` one chunk (its id) from, the routed bake
    in ``folder``: new chunks baked with its options and artefacts, the other chunks' folders
    kept as they are (hard links into the staged copy).

    Raises:
        CtxcError: not a routed bake, no such chunk, both or neither of ``documents`` and
            ``remove``, another model than the folder's.

    Side effects:
        replaces ``folder`` once all of it is written.
    """
    from ctxc.bake.run import preflight

    hooks = hooks or BakeHooks()
    if bool(documents) == (remove is not None):
        raise CtxcError("give the documents to add or the chunk to remove (one of them)")
    router = Router.load(folder)
    options = BakeOptions(**router.options)  # every chunk's, checked before anything is written
    # Both checked (one line) before anything is written: the chunk to drop, or the new files.
    after = router.removed(remove) if remove is not None else None
    chunks = [] if remove is not None else routed_chunks(documents, router.chunk_words)
    job = BakeJob(
        Path(folder),
        chunks=tuple(chunks),
        options=options,
        held=held or HeldOut(),
        emit=tuple(router.emit),
        model=model,
    )
    if chunks:
        preflight(job, hooks)
    reports: dict = {}
    with output_folder(Path(folder), True, "bake") as tmp:
        kept = [c for c in router.ids if c != remove]
        for cid in kept:
            shutil.copytree(
                Path(folder) / CHUNKS_DIR / cid, tmp / CHUNKS_DIR / cid, copy_function=os.link
            )
        if after is not None:
            after.save(tmp)
            lines = [f"removed chunk {remove}"]
        else:
            net, tokenizer = hooks.load(model, "float32")
            if kept:
                from ctxc.patch import Patch

                # Another model than the one the patches were made for: one line, nothing kept.
                Patch.load(Path(folder) / CHUNKS_DIR / kept[0], net).check(net)
            ids = router.next_ids(len(chunks))
            reports, lines = _bake_chunks(net, tokenizer, chunks, ids, job, tmp, hooks)
            router.added(ids, [t for _, t in chunks]).save(tmp)
    held_ids = Router.load(folder).ids
    return BakeRun(Path(folder), {"chunks": reports, "chunk_ids": list(held_ids)}, lines)


def _bake_chunks(net, tokenizer, chunks, ids: list[str], job: BakeJob, root: Path, hooks):
    """Bake each chunk alone into ``root/chunks/<id>/``: (each chunk's report by id, a summary
    line per chunk)."""
    from ctxc.bake.driver import bake
    from ctxc.bake.folder import write_bake

    reports, lines = {}, []
    for n, (cid, (name, text)) in enumerate(zip(ids, chunks, strict=True), 1):
        folder = root / CHUNKS_DIR / cid
        folder.mkdir(parents=True)
        count = len(text.split())
        hooks.on_stage(f"chunk {cid} ({n}/{len(chunks)}, from {name}, {count} words)")
        with hooks.progress("baking", "fitting") as (on_stage, on_block):
            result = bake(
                net,
                tokenizer,
                text,
                None,
                options=job.options,
                on_stage=on_stage,
                on_block=on_block,
            )
        result.report["route"] = {"chunk": cid, "file": name, "words": count}
        report = write_bake(net, tokenizer, result, folder, job.emit, job.held, hooks)
        reports[cid] = report
        figures = report["figures"]
        held = figures.get("held_out_samples") or figures.get("fit")
        kl = ""
        if held is not None:
            kl = f": KL {held['patched']['kl']:.3g} (unpatched {held['control']['kl']:.3g})"
        lines.append(f"chunk {cid} ({name}, {count} words){kl}")
    return reports, lines
