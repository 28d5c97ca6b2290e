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
from typing import Any

from ctxc._version import __version__
from ctxc.cli.job import CompileJob, compile_into
from ctxc.cli.options import cli_message
from ctxc.cli.output import MARKER
from ctxc.cli.progress import progress
from ctxc.cli.support import err, out, written
from ctxc.core.checks import ArtefactError
from ctxc.core.errors import CtxcError, environment_error
from ctxc.core.interrupts import pause_point
from ctxc.core.textfile import read_text

__all__ = ["compile_batch", "read_lines"]

_NAME = re.compile(r"[A-Za-z0-9._-]+")


def read_lines(path: Path) -> list[tuple[int, dict | None, str | None]]:
    """(line number, parsed entry or None, error or None) for every non-blank line of ``path``."""
    if path.is_dir():  # the reader would say "is not a file": say what --contexts takes
        raise CtxcError(f"--contexts takes a JSON Lines file; {path} is a folder")
    raw = read_text(path, "contexts file").splitlines()  # not blank: a line is left
    numbered = [(n, line) for n, line in enumerate(raw, 1) if line.strip()]
    width = max(4, len(str(numbered[-1][0])))
    seen: set[str] = set()
    lines = []
    for n, line in numbered:
        entry, problem = _parse(line, n, width)
        if entry is not None:
            if entry["name"] in seen:
                problem = f"duplicate name {entry['name']!r}"
                entry = None
            else:
                seen.add(entry["name"])
        lines.append((n, entry, problem))
    return lines


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
    contexts: Path, out_dir: Path, model, dtype: str, force: bool, opts: CompileJob, resume=False
):
    """Compile every line of ``contexts`` into ``out_dir``/<name>/, each kept as it finishes.

    ``index.json`` is rewritten after every line (the lines not reached: ``"not run"``); an
    interrupt keeps the finished lines. ``resume``: keep the lines an earlier run wrote
    (``compiler/cli/batch_out.py``).

    Returns:
        the exit status: 0 when every line succeeded, 1 when some failed.
    """
    from ctxc.cli.batch_out import batch_folder

    lines = read_lines(contexts)
    rows = [
        {"line": n, "name": entry["name"] if entry else None, "status": "not run"}
        for n, entry, _ in lines
    ]
    with batch_folder(out_dir, force, resume, _options(opts, dtype)) as folder:
        from ctxc.cli.support import load
        from ctxc.models.fingerprint import fingerprint

        net, tokenizer = load(model, dtype, opts.placement)
        folder.check_model(fingerprint(net))
        folder.write_index(rows)
        try:
            _run_lines(net, tokenizer, folder, lines, rows, opts)
        finally:  # an interrupt too: the finished lines are listed, the rest "not run"
            folder.write_index(rows)
    failed = sum(row["status"] == "error" for row in rows)
    done = len(rows) - failed
    if failed:
        err.print(
            f"compiled {done} of {len(rows)} contexts; {failed} failed "
            f"(see {out_dir / 'index.json'})",
            **_PLAIN,
        )
        return 1
    kinds = ", ".join(written(opts.kinds))
    out.print(f"compiled {done} of {len(rows)} contexts into {out_dir}/ ({kinds})", **_PLAIN)
    return 0


def _run_lines(net, tokenizer, folder, lines, rows: list[dict], opts: CompileJob) -> None:
    """Compile each line (or keep it, resuming), updating ``rows`` and index.json after each."""
    with _progress() as bar:
        task = bar.add_task("contexts", total=len(lines))
        for i, (n, entry, problem) in enumerate(lines):
            if entry is not None:
                problem, figures = _one(net, tokenizer, folder, entry, opts)
            row = {"line": n, "name": entry["name"] if entry else None}
            if problem is None:
                row.update(status="ok", **figures, folder=entry["name"])
            else:
                row.update(status="error", error=problem)
                err.print(f"ctxc: error: line {n}: {problem}", **_PLAIN)
            rows[i] = row
            folder.write_index(rows)
            bar.update(task, advance=1)
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


_PLAIN: dict[str, Any] = {"highlight": False, "markup": False, "soft_wrap": True}


def _progress():
    """Contexts done of all and the rate, on the command's progress trail (cli_progress.py)."""
    return progress(rate="contexts/s")


def _one(net, tokenizer, folder, entry: dict, opts: CompileJob):
    """(error or None, headline figures) for one context, moved into DIR/<name>/ when done.

    A line already written by an earlier run (``--resume``) is kept; an artefact that fails
    keeps the rest in DIR/<name>.failed/; an unexpected error is recorded for this line only.
    """
    import os

    from ctxc.cli.batch_out import headline, input_digest

    digest = input_digest(entry)
    kept = folder.finished(entry["name"], digest)
    if kept is not None:
        return None, kept
    staging = folder.staging(entry["name"])
    try:
        compile_into(
            net,
            tokenizer,
            staging,
            entry["context"],
            entry["query"],
            opts,
            messages=entry["messages"],
            on_stage=pause_point,
        )
        folder.commit(staging, entry["name"], digest)
    except ArtefactError as exc:
        where = folder.keep_failed(staging, entry["name"], exc.artefact)
        return f"{_line(exc)}; the patch and what passed are kept in {where}/", None
    except CtxcError as exc:
        folder.discard(staging)
        return _line(cli_message(exc)), None
    except Exception as exc:  # a bug on one line: recorded, and the other lines still run
        folder.discard(staging)
        refused = environment_error(exc)  # disk full, read-only, permissions: not a bug
        if refused is not None:
            return _line(str(refused)), None
        if os.environ.get("CTXC_DEBUG"):
            raise
        return f"internal error: {type(exc).__name__}: {_line(exc)}", None
    except BaseException:
        folder.discard(staging)
        raise
    return None, headline(json.loads((folder.final / entry["name"] / "report.json").read_text()))


def _line(exc: BaseException | str) -> str:
    return " ".join(str(exc).split())
