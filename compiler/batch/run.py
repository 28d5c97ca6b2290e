"""The batch run: many contexts, one model load and trace (issue 11), each into its own folder.

Every good line gets DIR/<name>/, exactly what a single ``ctxc compile`` writes; DIR/index.json
lists every line with its status and headline figures, rewritten after every line. The lines
compile here (one model load) or on a pool's workers (``pool.py``: a Ray cluster's,
``ray_engine.py``; this machine's processes, ``processes.py``). The run reports through
:class:`~ctxc.batch.hooks.BatchHooks` and prints nothing itself; its errors name the library's
parameters. :func:`run_lines` is the run of any line step (a routed bake's chunks go through
it); :func:`run_batch` is ``--contexts``'. No torch import at module level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ctxc._version import __version__
from ctxc.batch.hooks import BatchHooks
from ctxc.batch.job import CompileJob
from ctxc.batch.line import compile_line, record, settle
from ctxc.batch.lines import read_lines, refuse_bad_lines
from ctxc.batch.pool import Engine, Work
from ctxc.core.errors import CtxcError, OptionError
from ctxc.core.interrupts import note_interrupt, pause_point
from ctxc.core.vocabulary import DEFAULT_RULE, GGUF_F32

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["compile_many", "run_batch", "run_lines"]


def run_batch(
    contexts: Path | list[str],
    out_dir: Path,
    model: tuple[str | None, str],
    opts: CompileJob,
    mode: tuple[bool, bool] = (False, False),
    engine: Engine | None = None,
    hooks: BatchHooks | None = None,
) -> list[dict]:
    """Compile every line of ``contexts`` into ``out_dir``/<name>/, each kept as it finishes.

    ``index.json`` is rewritten after every line (the lines not reached: ``"not run"``); an
    interrupt keeps the finished lines. ``resume``: keep the lines an earlier run wrote
    (``compiler/batch/folder.py``).

    Args:
        contexts: the JSON Lines file, or its lines.
        out_dir: the output folder.
        model: ``(model, dtype)``: an alias, folder or ``.gguf`` file (None: the bundled
            model), and its dtype.
        opts: what every line is compiled with and into.
        mode: ``(force, resume)``: replace an earlier output; keep an earlier run's lines.
        engine: compile on a pool's workers (a Ray cluster's:
            :class:`~ctxc.batch.ray_engine.RayEngine`); None: here, one model load.
        hooks: the callbacks (:class:`~ctxc.batch.hooks.BatchHooks`); None: silent.

    Returns:
        the rows of index.json, one per line.

    Raises:
        CtxcError: a line bad as written (every one named, before the model loads), ``out_dir``
            refused, the model does not load.
    """
    lines = read_lines(contexts)
    refuse_bad_lines(lines, contexts)  # before the output folder and the model
    work = Work(compile_line, opts, placement=opts.placement)
    return run_lines(lines, out_dir, model, _options(opts, model[1]), mode, engine, hooks, work)


def run_lines(
    lines: list[tuple],
    out_dir: Path,
    model: tuple[str | None, str],
    options: dict,
    mode: tuple[bool, bool],
    engine: Engine | None,
    hooks: BatchHooks | None,
    work: Work,
    finish: Callable | None = None,
) -> list[dict]:
    """Run every line into ``out_dir`` with ``work``'s step, each kept as it finishes.

    Args:
        lines: ``(line number, entry or None, problem or None)`` per line
            (:func:`~ctxc.batch.lines.read_lines`'s); an entry has ``name``, ``context``,
            ``query`` and ``messages`` (its input digest's parts).
        out_dir: the output folder (laid out as ``work.layout`` says).
        model: ``(model, dtype)``.
        options: what a resume must match (stored in DIR's marker).
        mode: ``(force, resume)``.
        engine: the pool's engine (``engine.in_process(len(lines))``: here), or None: here.
        hooks: the callbacks; None: silent.
        work: the lines' step, options and layout.
        finish: ``(folder, rows)``, called with DIR still held once every line is settled
            (a routed bake writes its router), or None.

    Returns:
        the rows, one per line.

    Raises:
        CtxcError: ``out_dir`` refused, the model does not load.
    """
    from ctxc.batch.folder import batch_folder

    hooks = hooks or BatchHooks()
    force, resume = mode
    rows = [
        {"line": n, "name": entry["name"] if entry else None, "status": "not run"}
        for n, entry, _ in lines
    ]
    try:
        with batch_folder(out_dir, force, resume, options, work.layout) as folder:
            try:
                if engine is not None and not engine.in_process(len(lines)):
                    from ctxc.batch.pool import run_pooled

                    run_pooled(engine, model, folder, lines, rows, work, hooks)
                else:
                    _run_here(model, folder, lines, rows, (work, hooks))
            finally:  # an interrupt too: the finished lines are listed, the rest "not run"
                folder.write_index(rows)
            if finish is not None:
                finish(folder, rows)
    except KeyboardInterrupt:
        kept = sum(row["status"] == "ok" for row in rows)
        if kept:  # else DIR was removed: nothing to resume from
            again = _infinitive(work.layout.verb)
            template = f"{{}} of {{}} {work.noun} kept in {{}}/; rerun with {{resume}} to {again} "
            note = CtxcError().naming(template + "the rest", kept, len(rows), out_dir)
            note_interrupt(note.render(hooks.name_of))
        raise
    return rows


def _infinitive(verb: str) -> str:
    """``compiled`` -> ``compile``, ``baked`` -> ``bake``: a layout's verb in a message."""
    return verb[:-1] if verb.endswith("ed") else verb


def _run_here(model: tuple, folder, lines, rows: list[dict], run: tuple) -> None:
    """Load the model here and run each line in turn (:func:`_run_lines`).

    Args:
        run: ``(work, hooks)``.
    """
    from ctxc.models.fingerprint import fingerprint

    work, hooks = run
    net, tokenizer = hooks.load(*model, work.placement)
    folder.check_model(fingerprint(net))
    folder.write_index(rows)
    hooks.on_workers(1)
    _run_lines((net, tokenizer), folder, lines, rows, run)


def _run_lines(loaded: tuple, folder, lines, rows: list[dict], run: tuple) -> None:
    """Run each line (or keep it, resuming), updating ``rows`` and the index after each."""
    hooks = run[1]
    hooks.on_lines(0, len(lines), False)
    for i, (n, entry, problem) in enumerate(lines):
        figures, kept = None, False
        if entry is not None:
            problem, figures, kept = _one(loaded, folder, entry, run)
        record(rows, i, (n, entry), (problem, figures), hooks.on_error)
        folder.write_index(rows)
        hooks.on_lines(i + 1, len(lines), kept)  # a kept line is not in the rate
        pause_point(f"line {n} done")


def _options(opts: CompileJob, dtype: str) -> dict:
    """What must match for a resume to keep earlier lines (the model: its fingerprint)."""
    where = opts.placement
    return {
        "ctxc_version": __version__,
        "dtype": dtype,
        "update": opts.compile.update,
        "start_layer": opts.compile.start_layer,
        "skip_unpatchable": opts.compile.skip_unpatchable,
        "emit": list(opts.kinds),
        "gguf_type": opts.gguf_type,
        "device": getattr(where, "device", None),
        "device_map": getattr(where, "device_map", None),
        "max_memory": None if where is None else repr(where.max_memory),
    }


def _one(loaded: tuple, folder, entry: dict, run: tuple):
    """(error or None, row figures, kept) for one line, moved into DIR when done; ``kept``: a
    line already written by an earlier run (``resume``, :meth:`finished`).
    """
    from ctxc.batch.folder import input_digest

    work, hooks = run
    net, tokenizer = loaded
    digest = input_digest(entry)
    kept = folder.finished(entry["name"], digest)
    if kept is not None:
        return None, kept, True
    staging = folder.staging(entry["name"])
    try:
        step = work.here or work.step
        outcome = step(net, tokenizer, staging, entry, work.opts, hooks.name_of, hooks.on_emit)
    except BaseException:
        folder.discard(staging)
        raise
    return (*settle(folder, staging, entry, digest, outcome, hooks.name_of), False)


def compile_many(
    contexts: str | Path | list[dict],
    out: str | Path,
    *,
    model: str | None = None,
    dtype: str = "float32",
    emit: tuple[str, ...] | list[str] = ("torch",),
    update: str = DEFAULT_RULE,
    start_layer: int = 0,
    skip_unpatchable: bool = False,
    gguf_type: str = GGUF_F32,
    device: str | None = None,
    engine: str = "local",
    address: str | None = None,
    workers: int | None = None,
    gpus_per_worker: float = 0.0,
    resume: bool = False,
    force: bool = False,
) -> list[dict]:
    """``ctxc compile --contexts`` from Python: every context into ``out``/<name>/.

    The same run as the command (docs/cluster.md): the same folders, index.json and
    ``resume``; ``engine="ray"`` hands the lines to a Ray cluster's workers (``ctxc[ray]``;
    a Ray already initialised in this process is used as it is). Nothing is printed; an error
    names these parameters (``workers must be at least 1``).

    Args:
        contexts: a JSON Lines file, or its lines as dicts (``context``, ``query``, ``name``,
            or a chat line's ``messages``/``system``/``document``).
        out: the output folder.
        model, dtype, emit, update, start_layer, skip_unpatchable, gguf_type, device: as the
            command's options.
        engine: ``"local"`` (this process, one model load) or ``"ray"``.
        address, workers, gpus_per_worker: the Ray cluster and pool
            (:class:`~ctxc.batch.ray_engine.RayEngine`).
        resume, force: keep an earlier run's lines in ``out``; replace an earlier output.

    Returns:
        index.json's rows, one per line (``status`` ``"ok"`` or ``"error"``).

    Raises:
        CtxcError: bad options, ``out`` refused, the model does not load, or ray is missing.
    """
    from ctxc.backends import check_rules, parse_backends
    from ctxc.core.options import CompileOptions
    from ctxc.models.devices import Placement

    if engine not in ("local", "ray"):
        raise OptionError("{engine} must be 'local' or 'ray', not {!r}", engine)
    on = None
    if engine == "ray":
        from ctxc.batch.ray_engine import RayEngine, require_ray

        require_ray()
        on = RayEngine(address=address, workers=workers, gpus_per_worker=gpus_per_worker)
    kinds = parse_backends(",".join(emit), "emit")
    compiling = CompileOptions(update, start_layer, skip_unpatchable)
    check_rules(kinds, compiling.update)
    job = CompileJob(compiling, kinds, gguf_type, placement=Placement.parse(device, None, None))
    source = Path(contexts) if isinstance(contexts, (str, Path)) else _as_lines(contexts)
    return run_batch(source, Path(out), (model, dtype), job, (force, resume), on)


def _as_lines(entries) -> list[str]:
    """Python dicts as the JSON lines a file would hold (one parser for both)."""
    return [json.dumps(e) if isinstance(e, dict) else "[not a dict]" for e in entries]
