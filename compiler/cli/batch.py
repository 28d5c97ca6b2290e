"""``ctxc compile --contexts FILE.jsonl``: many contexts, one model load and trace (issue 11).

Each line is a JSON object: ``context`` (required), ``query`` and ``name`` (optional); a
chat line gives ``messages`` or ``system`` and/or ``document`` instead of ``context``
(docs/chat.md). Every good line gets DIR/<name>/, exactly what a single ``ctxc compile``
writes; DIR/index.json lists every line with its status and headline figures. No torch
import at module level.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ctxc._version import __version__
from ctxc.cli.batch_line import PLAIN, batch_progress, compile_line, record, settle
from ctxc.cli.job import CompileJob
from ctxc.cli.output import MARKER
from ctxc.cli.support import err, out, written
from ctxc.core.errors import CtxcError
from ctxc.core.interrupts import note_interrupt, pause_point
from ctxc.core.textfile import read_text
from ctxc.core.vocabulary import DEFAULT_RULE

if TYPE_CHECKING:
    from ctxc.cli.ray_engine import RayEngine

__all__ = ["compile_batch", "compile_many", "read_lines", "refuse_bad_lines", "run_batch"]

_NAME = re.compile(r"[A-Za-z0-9._-]+")


def read_lines(path: Path | list[str]) -> list[tuple[int, dict | None, str | None]]:
    """(line number, parsed entry or None, error or None) for every non-blank line of ``path``
    (a JSON Lines file, or its lines)."""
    if isinstance(path, list):
        raw = path
        if not any(line.strip() for line in raw):
            raise CtxcError("no contexts given (an empty list)")
    elif path.is_dir():  # the reader would say "is not a file": say what --contexts takes
        raise CtxcError(f"--contexts takes a JSON Lines file; {path} is a folder")
    else:
        raw = read_text(path, "contexts file").splitlines()  # not blank: a line is left
    numbered = [(n, line) for n, line in enumerate(raw, 1) if line.strip()]
    width = max(4, len(str(numbered[-1][0])))
    seen: dict[str, int] = {}
    lines = []
    for n, line in numbered:
        entry, problem = _parse(line, n, width)
        if entry is not None:
            if entry["name"] in seen:
                problem = f"duplicate name {entry['name']!r} (line {seen[entry['name']]} has it)"
                entry = None
            else:
                seen[entry["name"]] = n
        lines.append((n, entry, problem))
    return lines


def refuse_bad_lines(lines: list[tuple[int, dict | None, str | None]], source) -> None:
    """Refuse the whole file, before the model loads, when a line is bad as written (not JSON,
    a missing context, a bad or duplicate name): every such line in one message, so one edit
    fixes them all. What only the model can tell (a context past its positions) stays an
    error of its own line in index.json.

    Args:
        lines: :func:`read_lines`' answer.
        source: the file, or a list of lines (``ctxc.compile_many``).

    Raises:
        CtxcError: ``FILE: 2 bad lines (nothing was run): line 2: ...; line 5: ...``.
    """
    bad = [(n, problem) for n, entry, problem in lines if entry is None]
    if bad:
        where = source if isinstance(source, Path) else "contexts"
        listed = "; ".join(f"line {n}: {problem}" for n, problem in bad)
        many = "line" if len(bad) == 1 else "lines"
        raise CtxcError(f"{where}: {len(bad)} bad {many} (nothing was run): {listed}")


def _parse(line: str, n: int, width: int) -> tuple[dict | None, str | None]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"not JSON: {exc.msg} (column {exc.colno})"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    context, query = obj.get("context"), obj.get("query")
    name = obj.get("name", f"{n:0{width}d}")
    turns = None
    if any(k in obj for k in _CHAT_KEYS):
        turns, query, problem = _chat_line(obj)
        if problem is not None:
            return None, problem
    elif not isinstance(context, str) or not context.strip():
        return None, "missing or empty 'context' (a non-empty string)"
    if query is not None and (not isinstance(query, str) or query == ""):
        return None, "'query' must be a non-empty string"  # " " is a query: real tokens
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        return None, f"bad name {name!r} (letters, digits, '.', '_', '-')"
    if name in ("index.json", MARKER) or name.startswith(".") or name.endswith(".failed"):
        return None, f"bad name {name!r} (reserved: index.json, a leading '.', '.failed')"
    return {"context": context, "query": query, "name": name, "messages": turns}, None


_CHAT_KEYS = ("messages", "system", "document")


def _chat_line(obj: dict) -> tuple[list | None, str | None, str | None]:
    """(context turns, query, None) of a chat line, or (None, None, what is wrong)."""
    from ctxc.core.chat import chat_messages

    if "context" in obj:
        return None, None, "'context' and a chat line's messages/system/document: give one"
    parts = {k: obj.get(k) for k in _CHAT_KEYS}
    for key in ("system", "document"):
        if parts[key] is not None and not isinstance(parts[key], str):
            return None, None, f"'{key}' must be a string"
    query = obj.get("query")
    if query is not None and not isinstance(query, str):
        return None, None, "'query' must be a non-empty string"
    try:
        turns, query = chat_messages(**parts, query=query)
    except CtxcError as exc:
        return None, None, exc.render(lambda p: f"'{p}'")
    return turns, query, None


def compile_batch(
    contexts: Path,
    out_dir: Path,
    model,
    dtype: str,
    force: bool,
    opts: CompileJob,
    resume=False,
    engine: RayEngine | None = None,
):
    """Compile every line of ``contexts`` into ``out_dir``/<name>/ and say how it went.

    See :func:`run_batch`; ``engine``: a Ray cluster's workers (``--engine ray``), or None.

    Returns:
        the exit status: 0 when every line succeeded, 1 when some failed.
    """
    rows = run_batch(contexts, out_dir, model, dtype, force, opts, resume, engine)
    failed = sum(row["status"] == "error" for row in rows)
    done = len(rows) - failed
    if failed:
        err.print(
            f"compiled {done} of {len(rows)} contexts; {failed} failed "
            f"(see {out_dir / 'index.json'})",
            **PLAIN,
        )
        return 1
    kinds = ", ".join(written(opts.kinds))
    out.print(f"compiled {done} of {len(rows)} contexts into {out_dir}/ ({kinds})", **PLAIN)
    return 0


def run_batch(
    contexts: Path | list[str],
    out_dir: Path,
    model,
    dtype: str,
    force: bool,
    opts: CompileJob,
    resume=False,
    engine: RayEngine | None = None,
) -> list[dict]:
    """Compile every line of ``contexts`` into ``out_dir``/<name>/, each kept as it finishes.

    ``index.json`` is rewritten after every line (the lines not reached: ``"not run"``); an
    interrupt keeps the finished lines. ``resume``: keep the lines an earlier run wrote
    (``compiler/cli/batch_out.py``).

    Args:
        contexts: the JSON Lines file, or its lines.
        engine: compile on a Ray cluster's workers (``compiler/cli/ray_engine.py``); None:
            here, one model load.

    Returns:
        the rows of index.json, one per line.
    """
    from ctxc.cli.batch_out import batch_folder

    lines = read_lines(contexts)
    refuse_bad_lines(lines, contexts)  # before the output folder and the model
    rows = [
        {"line": n, "name": entry["name"] if entry else None, "status": "not run"}
        for n, entry, _ in lines
    ]
    try:
        with batch_folder(out_dir, force, resume, _options(opts, dtype)) as folder:
            try:
                if engine is not None:
                    from ctxc.cli.ray_engine import run_on_ray

                    run_on_ray(engine, (model, dtype), folder, lines, rows, opts)
                else:
                    _run_here(model, dtype, folder, lines, rows, opts)
            finally:  # an interrupt too: the finished lines are listed, the rest "not run"
                folder.write_index(rows)
    except KeyboardInterrupt:
        kept = sum(row["status"] == "ok" for row in rows)
        if kept:  # else DIR was removed: nothing to resume from
            note_interrupt(
                f"{kept} of {len(rows)} contexts kept in {out_dir}/; rerun with --resume to "
                "compile the rest"
            )
        raise
    return rows


def _run_here(model, dtype: str, folder, lines, rows: list[dict], opts: CompileJob) -> None:
    """Load the model here and compile each line in turn (:func:`_run_lines`)."""
    from ctxc.cli.support import load
    from ctxc.models.fingerprint import fingerprint

    net, tokenizer = load(model, dtype, opts.placement)
    folder.check_model(fingerprint(net))
    folder.write_index(rows)
    _run_lines(net, tokenizer, folder, lines, rows, opts)


def _run_lines(net, tokenizer, folder, lines, rows: list[dict], opts: CompileJob) -> None:
    """Compile each line (or keep it, resuming), updating ``rows`` and index.json after each."""
    with batch_progress() as bar:
        task = bar.add_task("contexts", total=len(lines))
        for i, (n, entry, problem) in enumerate(lines):
            figures, kept = None, False
            if entry is not None:
                problem, figures, kept = _one(net, tokenizer, folder, entry, opts)
            record(rows, i, (n, entry), problem, figures)
            folder.write_index(rows)
            bar.update(task, advance=1, kept=kept)  # a kept line is not in the rate
            pause_point(f"line {n} done")


def _options(opts: CompileJob, dtype: str) -> dict:
    """What must match for a --resume to keep earlier lines (the model: its fingerprint)."""
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


def _one(net, tokenizer, folder, entry: dict, opts: CompileJob):
    """(error or None, headline figures, kept) for one context, moved into DIR/<name>/ when
    done; ``kept``: a line already written by an earlier run (``--resume``, :meth:`finished`).
    """
    from ctxc.cli.batch_out import input_digest

    digest = input_digest(entry)
    kept = folder.finished(entry["name"], digest)
    if kept is not None:
        return None, kept, True
    staging = folder.staging(entry["name"])
    try:
        outcome = compile_line(net, tokenizer, staging, entry, opts)
    except BaseException:
        folder.discard(staging)
        raise
    return (*settle(folder, staging, entry, digest, outcome), False)


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
    gguf_type: str = "F32",
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
    a Ray already initialised in this process is used as it is).

    Args:
        contexts: a JSON Lines file, or its lines as dicts (``context``, ``query``, ``name``,
            or a chat line's ``messages``/``system``/``document``).
        out: the output folder.
        model, dtype, emit, update, start_layer, skip_unpatchable, gguf_type, device: as the
            command's options.
        engine: ``"local"`` (this process, one model load) or ``"ray"``.
        address, workers, gpus_per_worker: the Ray cluster and pool
            (:class:`~ctxc.cli.ray_engine.RayEngine`).
        resume, force: keep an earlier run's lines in ``out``; replace an earlier output.

    Returns:
        index.json's rows, one per line (``status`` ``"ok"`` or ``"error"``).

    Raises:
        CtxcError: bad options, ``out`` refused, the model does not load, or ray is missing.
    """
    from ctxc.cli.options import placement_for
    from ctxc.cli.support import parse_emit
    from ctxc.core.options import CompileOptions

    if engine not in ("local", "ray"):
        raise CtxcError(f"engine must be 'local' or 'ray', not {engine!r}")
    on = None
    if engine == "ray":
        from ctxc.cli.ray_engine import RayEngine, require_ray

        require_ray()
        on = RayEngine(address=address, workers=workers, gpus_per_worker=gpus_per_worker)
    from ctxc.backends import check_rules

    kinds = parse_emit(",".join(emit))
    compiling = CompileOptions(update, start_layer, skip_unpatchable)
    check_rules(kinds, compiling.update)
    job = CompileJob(compiling, kinds, gguf_type, placement=placement_for(device, None, None))
    source = Path(contexts) if isinstance(contexts, (str, Path)) else _as_lines(contexts)
    return run_batch(source, Path(out), model, dtype, force, job, resume, on)


def _as_lines(entries) -> list[str]:
    """Python dicts as the JSON lines a file would hold (one parser for both)."""
    return [json.dumps(e) if isinstance(e, dict) else "[not a dict]" for e in entries]
