"""The lines of a batch run: a JSON Lines file (``ctxc compile --contexts``) or a list of them.

Each line is a JSON object: ``context`` (required), ``query`` and ``name`` (optional); a
chat line gives ``messages`` or ``system`` and/or ``document`` instead of ``context``
(docs/chat.md). A line bad as written (not JSON, no context, a bad or duplicate name) refuses
the whole run before the model loads (:func:`refuse_bad_lines`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ctxc.core.errors import CtxcError
from ctxc.core.textfile import read_text
from ctxc.store.output import MARKER

__all__ = ["read_lines", "refuse_bad_lines"]

_NAME = re.compile(r"[A-Za-z0-9._-]+")


def read_lines(path: Path | list[str]) -> list[tuple[int, dict | None, str | None]]:
    """(line number, parsed entry or None, error or None) for every non-blank line of ``path``
    (a JSON Lines file, or its lines)."""
    if isinstance(path, list):
        raw = path
        if not any(line.strip() for line in raw):
            raise CtxcError("no contexts given (an empty list)")
    elif path.is_dir():  # the reader would say "is not a file": say what contexts takes
        raise CtxcError().naming("{contexts} takes a JSON Lines file; {} is a folder", path)
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
        source: the file, or a list of lines (``ctxc.compile_many``'s dicts).

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
