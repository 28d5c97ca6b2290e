"""One line of a batch run (``ctxc compile --contexts``, a routed bake's chunk), the steps every
engine shares.

A line's step runs it into its staging folder (in this process, a worker process or a Ray
worker: ``compiler/batch/pool.py``); :func:`compile_line` is a ``--contexts`` line's, and
:func:`guarded` the error handling every step shares. :func:`settle` moves a line into DIR by how
that ended and :func:`record` sets its row of index.json (in the process that holds DIR,
``compiler/batch/folder.py``). No torch import at module level.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ctxc.batch.job import CompileJob, compile_into
from ctxc.core.checks import ArtefactError
from ctxc.core.errors import CtxcError, environment_error
from ctxc.core.interrupts import pause_point

__all__ = ["LineOutcome", "Step", "compile_line", "guarded", "record", "settle"]


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


# A line's step: ``(net, tokenizer, staging, entry, opts, name_of, on_emit) -> LineOutcome``,
# a module-level function (a worker process is handed it by name).
Step = Callable[..., LineOutcome]


def guarded(run: Callable[[], object], name_of: Callable[[str], str] = str) -> LineOutcome:
    """Run one line's work (``run``) and say how it ended, as every step does.

    An unexpected error is this line's alone (re-raised with ``CTXC_DEBUG``); an interrupt
    propagates.

    Args:
        run: the line's work, writing into its staging folder only.
        name_of: how an error names a library parameter (the CLI: its flag).

    Returns:
        the :class:`LineOutcome`: ``"failed"`` for an artefact that failed its check,
        ``"error"`` for any other error, else ``"ok"``.
    """
    try:
        run()
    except ArtefactError as exc:
        return LineOutcome("failed", _line(exc), exc.artefact)
    except Exception as exc:  # an error on one line: recorded, and the other lines still run
        return LineOutcome("error", _problem(exc, name_of))
    return LineOutcome("ok")


def compile_line(
    net,
    tokenizer,
    staging: Path,
    entry: dict,
    opts: CompileJob,
    name_of: Callable[[str], str] = str,
    on_emit: Callable[[str], None] | None = None,
) -> LineOutcome:
    """Compile line ``entry`` into ``staging``: a ``--contexts`` line's :data:`Step`
    (:func:`guarded`). Nothing here touches DIR but ``staging``.

    Args:
        name_of: how an error names a library parameter (the CLI: its flag).
        on_emit: each artefact's status line, or None.

    Returns:
        the :class:`LineOutcome`.
    """

    def run() -> None:
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

    return guarded(run, name_of)


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
        (error or None, the row figures (``folder.layout.summary``) or None).
    """
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
    return None, folder.figures(entry["name"])


def _line(exc: BaseException | str) -> str:
    return " ".join(str(exc).split())
