"""A routed bake's run: a long document cut into chunks of paragraphs, each baked alone into
its own folder, a router beside them (issue 36; the router itself: :mod:`ctxc.bake.route`).

:func:`bake_routed` writes ``DIR/chunks/<id>/`` (an ordinary bake folder: ``patch.safetensors``,
``report.json``, the ``emit`` artefacts) per chunk and ``DIR/router.json``;
:func:`change_routed` bakes new chunks with DIR's options and artefacts beside the others, or
drops one; neither touches another chunk's patch. With ``chat=True`` every chunk is a chat bake
whose system turn is the chunk (:func:`~ctxc.bake.route.chunk_turns`): its folder is what
``ctxc bake --chat --system CHUNK.txt`` writes, so a chat model (which answers nothing in plain
text) is served the document as one adapter per chunk; the router records the mode, and a
chunk added later is baked the same way. Prints nothing: the
:class:`~ctxc.bake.hooks.BakeHooks` hear of each chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ctxc.bake.hooks import BakeHooks, ChunkProgress
from ctxc.bake.job import BakeJob, BakeRun, HeldOut
from ctxc.bake.route import CHUNKS_DIR, ROUTER_FILE, Router, chunk_turns, split_chunks
from ctxc.batch.folder import Layout, check_mode
from ctxc.batch.hooks import BatchHooks
from ctxc.batch.pool import Work
from ctxc.core.errors import CtxcError, OptionError
from ctxc.core.options import BakeOptions
from ctxc.core.vocabulary import ADDITIVE_METHOD
from ctxc.store.output import output_folder

__all__ = [
    "CHUNKS_DIR",
    "ROUTED_LAYOUT",
    "ChunkJob",
    "bake_chunk",
    "bake_routed",
    "change_routed",
    "is_routed",
    "routed_chunks",
]


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


def bake_routed(
    job: BakeJob,
    chunk_words: int,
    hooks: BakeHooks | None = None,
    *,
    chat: bool = False,
    workers: int | None = None,
    engine: str = "local",
    address: str | None = None,
    resume: bool = False,
) -> BakeRun:
    """Every chunk of ``job.chunks`` (whole documents, cut at blank lines into chunks of at
    most ``chunk_words`` words) baked alone with ``job.options``, the router beside them.

    The chunks are the lines of a batch run (``ctxc.batch``): baked side by side by worker
    processes (or a Ray cluster's workers), each chunk's folder renamed into ``DIR/chunks/``
    when complete, so an interrupt keeps every finished chunk and ``resume`` bakes the rest.
    The router is written once every chunk is there.

    Args:
        job: the request (``job.force``: replace an earlier output).
        chunk_words: the most words of a chunk joining paragraphs.
        hooks: the callbacks (``on_chunks``: each chunk's progress); None: silent.
        chat: bake each chunk as a chat bake whose one context turn is the chunk as a system
            turn (the model's chat template needed; the fit queries and held-out sets are user
            turns after it), as ``bake_into`` bakes ``messages=[{"role": "system", "content":
            chunk}]``; recorded in the router (``change_routed`` adds chat chunks) and in the
            resume marker (a resume of the other mode is refused).
        workers: worker processes (each its own model, sharing this process's torch
            threads: :func:`~ctxc.batch.pool.worker_threads`); 1: every chunk in this
            process; None: as many as the threads and the memory hold
            (:class:`~ctxc.batch.processes.LocalEngine`). With ``engine="ray"``: the pool's
            size (:class:`~ctxc.batch.ray_engine.RayEngine`).
        engine: ``"local"`` or ``"ray"`` (``ctxc[ray]``).
        address: the Ray cluster (``engine="ray"`` only); None: a local Ray.
        resume: keep the chunks an earlier run with the same options, texts and mode
            (``chat``) wrote in ``job.out`` (refused in one line otherwise, before any model
            loads).

    Returns:
        the :class:`BakeRun`: its report holds each chunk's report under ``chunks`` (by id)
        and every chunk's id under ``chunk_ids``.

    Raises:
        CtxcError: additive options, chat turns (``chat`` cuts ``job.chunks`` instead) or
            fit queries (each chunk fits on its own data), an empty document, a context past
            the model's positions, a chat bake on a model without a chat template, bad engine
            options, ``job.out`` refused or holding another run to resume, a chunk that failed
            (the others kept).

    Side effects:
        writes ``job.out``, each chunk as it finishes.
    """
    from ctxc.bake.run import preflight
    from ctxc.batch.run import run_lines

    hooks = hooks or BakeHooks()
    if job.options.method == ADDITIVE_METHOD:
        raise CtxcError("a routed bake bakes each chunk alone: give method fit or distill")
    if job.messages is not None or job.queries is not None:
        raise CtxcError(
            "a routed bake cuts its documents into chunks (chat=True: each chunk a system turn) "
            "and fits each on its own data (no chat turns, no queries)"
        )
    chunks = routed_chunks(job.chunks, chunk_words)
    check_mode(job.force, resume)
    on = _engine(engine, workers, address, job.model)
    preflight(dataclasses.replace(job, chunks=tuple(chunks)), hooks, chat_chunks=chat)
    router = Router((), (), dataclasses.asdict(job.options), chunk_words, tuple(job.emit), chat)
    ids = router.next_ids(len(chunks))
    router = router.added(ids, [t for _, t in chunks])
    lines = [
        (n, {"name": cid, "context": text, "query": None, "messages": None, "file": name}, None)
        for n, (cid, (name, text)) in enumerate(zip(ids, chunks, strict=True), 1)
    ]
    chunk_job = ChunkJob(job.options, job.held, tuple(job.emit), chat)
    work = Work(
        bake_chunk,
        chunk_job,
        ROUTED_LAYOUT,
        split_threads=True,
        noun="chunks",
        here=functools.partial(bake_chunk, hooks=hooks),
    )

    def finish(folder, rows: list[dict]) -> None:
        if all(row["status"] == "ok" for row in rows):
            folder.write_file(ROUTER_FILE, router.text())

    options = _resume_options(job, chunk_words, chunks, chat)
    batch = _batch_hooks(hooks)
    model = (job.model, "float32")
    rows = run_lines(lines, job.out, model, options, (job.force, resume), on, batch, work, finish)
    failed = [row for row in rows if row["status"] != "ok"]
    if failed:
        raise CtxcError().naming(
            "chunk {} failed: {}; {} of {} chunks kept in {}/ ({resume} bakes the rest)",
            failed[0]["name"],
            failed[0].get("error", "not run"),
            len(rows) - len(failed),
            len(rows),
            job.out,
        )
    reports = {row["name"]: row["report"] for row in rows}
    lines_out = [_summary(cid, reports[cid]) for cid in ids]
    return BakeRun(Path(job.out), {"chunks": reports, "chunk_ids": ids}, lines_out)


def _whole(report: dict) -> dict:
    """A chunk's row: its whole report (the run's result, not an index)."""
    return {"report": report}


# A routed bake's DIR as a batch run writes it: DIR/chunks/<id>/ per chunk, no index (the
# router, written last, lists the chunks).
ROUTED_LAYOUT = Layout(
    command="bake", under=CHUNKS_DIR, index=None, summary=_whole, run="routed bake", verb="baked"
)
# A worker's peak memory, in float32 model sizes: a paragraph's bake of Gemma 3 270M (1.07 GB
# of float32 weights) peaked at 3.97 GiB (docs/bake.md, Long documents).
_PEAK_PER_MODEL = 4


@dataclasses.dataclass(frozen=True)
class ChunkJob:
    """What each chunk of a routed bake is baked with (handed to every worker).

    Attributes:
        options: the fit's options.
        held: what its figures are measured on.
        emit: the artefacts each chunk's folder gets.
        chat: each chunk baked as a chat bake, the chunk its system turn
            (:func:`~ctxc.bake.route.chunk_turns`).
    """

    options: BakeOptions
    held: HeldOut
    emit: tuple[str, ...]
    chat: bool = False


def bake_chunk(
    net,
    tokenizer,
    staging: Path,
    entry: dict,
    job: ChunkJob,
    name_of: Callable[[str], str] = str,
    on_emit: Callable[[str], None] | None = None,
    hooks: BakeHooks | None = None,
):
    """Bake chunk ``entry`` into ``staging``: a routed bake's line step
    (:data:`~ctxc.batch.line.Step`, the same in this process, a worker process or a Ray
    worker).

    Args:
        entry: the chunk's ``name`` (its id), ``context`` (its text) and ``file``.
        job: the bake's options, held-out sets and artefacts.
        name_of: how an error names a library parameter.
        on_emit: unused (a compile's artefact lines).
        hooks: the reporters of a chunk baked in this process (a worker's are silent).

    Returns:
        the :class:`~ctxc.batch.line.LineOutcome`.
    """
    from ctxc.batch.line import guarded

    mine = hooks or BakeHooks()
    return guarded(lambda: _bake_one(net, tokenizer, staging, entry, job, mine), name_of)


def _bake_one(net, tokenizer, folder: Path, entry: dict, job: ChunkJob, hooks: BakeHooks) -> dict:
    """Bake one chunk alone into ``folder``: its report as written (a chat chunk's folder is
    what ``bake_into`` writes for the chunk as its one system turn, ``route`` added)."""
    from ctxc.bake.driver import bake
    from ctxc.bake.folder import write_bake

    cid, text = entry["name"], entry["context"]
    count = len(text.split())
    hooks.on_stage(f"chunk {cid} (from {entry['file']}, {count} words)")
    # A chat chunk: no text, the chunk the one system turn (bake_into's call for --chat --system).
    messages = chunk_turns(text) if job.chat else None
    with hooks.progress("baking", "fitting") as (on_stage, on_block):
        result = bake(
            net,
            tokenizer,
            None if job.chat else text,
            None,
            options=job.options,
            messages=messages,
            on_stage=on_stage,
            on_block=on_block,
            emit=job.emit,
        )
    result.report["route"] = {"chunk": cid, "file": entry["file"], "words": count}
    return write_bake(net, tokenizer, result, folder, job.emit, job.held, hooks)


def _summary(cid: str, report: dict) -> str:
    """A chunk's summary line: its file, its words and its held-out KL."""
    route = report["route"]
    figures = report["figures"]
    held = figures.get("held_out_samples") or figures.get("fit")
    kl = ""
    if held is not None:
        kl = f": KL {held['patched']['kl']:.3g} (unpatched {held['control']['kl']:.3g})"
    return f"chunk {cid} ({route['file']}, {route['words']} words){kl}"


def _engine(engine: str, workers: int | None, address: str | None, model: str | None):
    """The chunks' engine: worker processes here, or a Ray cluster (ray checked now).

    Raises:
        OptionError: an unknown engine, ``workers`` below 1, ``address`` without Ray.
    """
    if engine not in ("local", "ray"):
        raise OptionError("{engine} must be 'local' or 'ray', not {!r}", engine)
    if engine == "local":
        if address is not None:
            raise OptionError("{address} applies to {engine} ray")
        from ctxc.batch.processes import LocalEngine

        memory = None if workers is not None else _memory_per_worker(model)
        return LocalEngine(workers, memory)
    from ctxc.batch.ray_engine import RayEngine, require_ray

    require_ray()
    return RayEngine(address=address, workers=workers)


def _memory_per_worker(model: str | None) -> int | None:
    """A worker's expected peak bytes: :data:`_PEAK_PER_MODEL` times the model's float32
    weights (its weight files' bytes at their stored dtype's size); None when unknown."""
    from ctxc.models.load import model_directory

    try:
        directory = model_directory(model)
        config = json.loads((directory / "config.json").read_text())
        stored = sum(
            f.stat().st_size
            for pattern in ("*.safetensors", "*.bin")
            for f in directory.glob(pattern)
        )
    except (CtxcError, OSError, ValueError):
        return None
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    size = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 2)  # unsure: the larger model
    return _PEAK_PER_MODEL * stored * 4 // size or None


def _resume_options(
    job: BakeJob, chunk_words: int, chunks: list[tuple[str, str]], chat: bool
) -> dict:
    """What a resume must match (DIR's marker): the fit's options, the held-out sets, the
    artefacts, the model as named, the chunks' files and texts (a digest), and whether they
    are chat chunks (the same texts baked the other way are other patches)."""
    from ctxc._version import __version__

    model = job.model
    if model is not None and Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())  # the same folder however it is named
    texts = hashlib.sha256(json.dumps(chunks).encode()).hexdigest()
    held = {f"eval_{k}": v for k, v in dataclasses.asdict(job.held).items()}
    options = {
        "ctxc_version": __version__,
        **dataclasses.asdict(job.options),
        **held,
        "chunk_words": chunk_words,
        "emit": list(job.emit),
        "model": model,
        "documents_sha256": texts,
        "chat": chat,
    }
    return json.loads(json.dumps(options))  # as the marker holds them: lists, not tuples


class _Clock:
    """``BatchHooks.on_lines`` as a bake's :class:`ChunkProgress` (elapsed, time left)."""

    def __init__(self, on_chunks: Callable[[ChunkProgress], None]) -> None:
        self.on_chunks = on_chunks
        self.start = time.perf_counter()
        self.width = 1
        self.done = self.kept = 0

    def workers(self, width: int) -> None:
        """The chunks begin on ``width`` workers, their models loaded: the clock starts."""
        self.start, self.width = time.perf_counter(), width

    def __call__(self, done: int, total: int, kept: bool) -> None:
        if done <= self.done:
            return
        if kept:
            self.kept += done - self.done
        self.done = done
        elapsed = time.perf_counter() - self.start
        baked = done - self.kept
        # The first chunks end together, one a worker: each took about the time so far.
        left = elapsed / max(baked, self.width) * (total - done) if baked else None
        self.on_chunks(ChunkProgress(done, total, self.kept, not kept, elapsed, left))


def _batch_hooks(hooks: BakeHooks) -> BatchHooks:
    """The batch run's hooks of a routed bake: its progress as :class:`ChunkProgress`, a chunk
    in this process loaded by ``hooks.load``, a worker's by ``load_with_stores``."""
    from ctxc.store.model_load import load_with_stores

    clock = _Clock(hooks.on_chunks)
    return BatchHooks(
        on_stage=lambda text, _keep: hooks.on_stage(text),
        on_lines=clock,
        on_workers=clock.workers,
        name_of=hooks.name_of,
        load=lambda model, dtype, _placement: hooks.load(model, dtype),
        worker_load=load_with_stores,
        setup=hooks.setup,
    )


def change_routed(
    folder: Path,
    documents: Sequence[tuple[str, str]] = (),
    remove: str | None = None,
    held: HeldOut | None = None,
    model: str | None = None,
    hooks: BakeHooks | None = None,
) -> BakeRun:
    """Add ``documents``' chunks to, or ``remove`` one chunk (its id) from, the routed bake
    in ``folder``: new chunks baked with its options, artefacts and mode (chat chunks in a
    routed chat bake: its router's ``chat``), the other chunks' folders kept as they are (hard
    links into the staged copy).

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
        preflight(job, hooks, chat_chunks=router.chat)
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
            chunk_job = ChunkJob(options, job.held, job.emit, router.chat)
            reports, lines = _bake_chunks(net, tokenizer, chunks, ids, chunk_job, tmp, hooks)
            router.added(ids, [t for _, t in chunks]).save(tmp)
    held_ids = Router.load(folder).ids
    return BakeRun(Path(folder), {"chunks": reports, "chunk_ids": list(held_ids)}, lines)


def _bake_chunks(net, tokenizer, chunks, ids: list[str], job: ChunkJob, root: Path, hooks):
    """Bake each chunk alone into ``root/chunks/<id>/`` (``--add``) with ``job``: (each
    chunk's report by id, a summary line per chunk)."""
    reports, lines = {}, []
    for n, (cid, (name, text)) in enumerate(zip(ids, chunks, strict=True), 1):
        folder = root / CHUNKS_DIR / cid
        folder.mkdir(parents=True)
        hooks.on_stage(f"chunk {n}/{len(chunks)}")
        entry = {"name": cid, "context": text, "file": name}
        reports[cid] = _bake_one(net, tokenizer, folder, entry, job, hooks)
        lines.append(_summary(cid, reports[cid]))
    return reports, lines
