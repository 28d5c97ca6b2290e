"""How a batch run reports, names its parameters and loads its model: the caller's choice.

The batch stage prints nothing and knows no flag. ``ctxc.compile_many`` runs it silently with
its errors naming the library's parameters (``workers=0``: ``workers must be at least 1``); the
command line (``compiler/cli/batch.py``) gives its progress trail, its stderr lines and its flag
names (``--workers``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ctxc.store.model_load import load_with_stores

__all__ = ["BatchHooks"]


def _silent(*_) -> None:
    """A hook that does nothing (the library's default: no output)."""


@dataclasses.dataclass(frozen=True)
class BatchHooks:
    """The callbacks of a batch run (every one optional).

    Attributes:
        on_stage: ``(text, keep)``: what the run does now (loading the model, a notice);
            ``keep``: a line worth keeping (a long step, a warning).
        on_lines: ``(done, total, kept)``: lines settled of all; called with 0 when the
            counting starts (after the model loads, on a Ray run before the workers start),
            then once per line; ``kept``: the line took no work (``resume``).
        on_error: ``(line number, message)``: a line failed (its row of index.json says so).
        on_workers: ``(width)``: the lines run on this many workers (1: this process), their
            models loaded; called once, before the first line is run.
        on_emit: each artefact's status line, for a line compiled in this process.
        name_of: how a message names a library parameter (the CLI: its flag).
        load: ``(model, dtype, placement) -> (net, tokenizer)``; a module-level function, as
            a worker is handed it (unless ``worker_load`` is given).
        worker_load: the load of a worker (a Ray worker, a worker process), a module-level
            function; None: ``load``.
        setup: called first in each worker's process (the CLI: its libraries quieted),
            a module-level function, or None.
        quiet_ray: drop Ray's token-authentication notice (the CLI keeps it with ``-v``).
    """

    on_stage: Callable[[str, bool], None] = _silent
    on_lines: Callable[[int, int, bool], None] = _silent
    on_error: Callable[[int, str], None] = _silent
    on_workers: Callable[[int], None] = _silent
    on_emit: Callable[[str], None] | None = None
    name_of: Callable[[str], str] = str
    load: Callable = load_with_stores
    worker_load: Callable | None = None
    setup: Callable[[], None] | None = None
    quiet_ray: bool = True
