"""One line of a batch run (``ctxc compile --contexts``), the steps every engine shares.

:func:`compile_line` compiles a line into its staging folder (in this process, or in a Ray
worker, ``compiler/batch/ray_engine.py``); :func:`settle` moves it into DIR by how that ended and
:func:`record` sets its row of index.json (in the process that holds DIR,
``compiler/batch/folder.py``). No torch import at module level.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctxc.batch.job import CompileJob, compile_into
from ctxc.core.checks import ArtefactError
from ctxc.core.errors import CtxcError, environment_error
from ctxc.core.interrupts import pause_point
from ctxc.core.vocabulary import REPORT_FILE

__all__ = ["LineOutcome", "compile_line", "record", "settle"]


def record(
    rows: list[dict],
    i: int,
    line: tuple,
    outcome: tuple[str | None, Any],
    on_error: Callable[[int, str], None],
    **extra,
) -> None:
    """Set ``rows[i]`` to line ``(n, entry)``'s outcome; an error is told ``on_error``.

    Args:
        outcome: ``(error or None, headline figures)``.
        on_error: ``(line number, message)`` (the CLI says it on stderr).
        extra: more fields of the row (a Ray run's ``attempts``).
    """
    problem, figures = outcome
    n, entry = line
    row = {"line": n, "name": entry["name"] if entry else None}
    if problem is None:
        row.update(status="ok", **figures, folder=entry["name"])
    else:
        row.update(status="error", error=problem)
        on_error(n, problem)
    rows[i] = {**row, **extra}


@dataclasses.dataclass(frozen=True)
class LineOutcome:
    """How one line's compile into its staging folder ended (sent back by a Ray worker).

    Attributes:
        kind: ``"ok"``; ``"failed"``: an artefact failed its check, the rest is in the
            staging folder; ``"error"``: nothing worth keeping.
        message: what went wrong, on one line (None when ok).
        artefact: the artefact that failed (``"failed"``).
    """

    kind: str
    message: str | None = None
    artefact: str | None = None


def compile_line(
    net,
    tokenizer,
    staging: Path,
    entry: dict,
    opts: CompileJob,
    name_of: Callable[[str], str] = str,
    on_emit: Callable[[str], None] | None = None,
) -> LineOutcome:
    """Compile line ``entry`` into ``staging``: the per-line step of every engine.

    An unexpected error is this line's alone (re-raised with ``CTXC_DEBUG``); an interrupt
    propagates. Nothing here touches DIR but ``staging``.

    Args:
        name_of: how an error names a library parameter (the CLI: its flag).
        on_emit: each artefact's status line, or None.

    Returns:
        the :class:`LineOutcome`.
    """
    try:
        compile_into(
            net,
            tokenizer,
            staging,
            entry["context"],
            entry["query"],
            opts,
            messages=entry["messages"],
            on_emit=on_emit,
            on_stage=pause_point,
        )
    except ArtefactError as exc:
        return LineOutcome("failed", _line(exc), exc.artefact)
    except Exception as exc:  # an error on one line: recorded, and the other lines still run
        return LineOutcome("error", _problem(exc, name_of))
    return LineOutcome("ok")


def _problem(exc: Exception, name_of: Callable[[str], str] = str) -> str:
    """A line's error on one line; an unexpected one is re-raised with ``CTXC_DEBUG``."""
    import os

    if isinstance(exc, CtxcError):
        return _line(exc.render(name_of))
    refused = environment_error(exc)  # disk full, read-only, permissions: not a bug
    if refused is not None:
        return _line(str(refused))
    if os.environ.get("CTXC_DEBUG"):
        raise exc
    return f"internal error: {type(exc).__name__}: {_line(exc)}"


def settle(
    folder,
    staging: Path,
    entry: dict,
    digest: str,
    outcome: LineOutcome,
    name_of: Callable[[str], str] = str,
):
    """Move a compiled line into DIR (or DIR/<name>.failed/, or discard it) by its outcome.

    Args:
        name_of: how an error names a library parameter (the CLI: its flag).

    Returns:
        (error or None, headline figures or None).
    """
    from ctxc.batch.folder import headline

    try:
        if outcome.kind == "failed":
            where = folder.keep_failed(staging, entry["name"], outcome.artefact)
            return f"{outcome.message}; the patch and what passed are kept in {where}/", None
        if outcome.kind != "ok":
            folder.discard(staging)
            return outcome.message, None
        folder.commit(staging, entry["name"], digest)
    except Exception as exc:  # DIR/<name> appeared meanwhile, the disk is full...
        folder.discard(staging)
        return _problem(exc, name_of), None
    except BaseException:
        folder.discard(staging)
        raise
    return None, headline(json.loads((folder.final / entry["name"] / REPORT_FILE).read_text()))


def _line(exc: BaseException | str) -> str:
    return " ".join(str(exc).split())
