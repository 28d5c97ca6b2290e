"""What the ``ctxc`` commands print besides their errors: progress on stderr, results on stdout.

One trail per command (issue 20). On a terminal it is one transient rich display: a spinner, what
is being done, a bar and ``n/N`` once a count is known, the command's elapsed seconds; every
stage of the command updates that one display, so two live displays never compete. When stderr
is not a terminal (a log, a pipe, CI) the trail is plain lines, ``ctxc: solving 12/18 blocks
(3.1 s)``: one per stage and one per tenth of a count, so a log stays short. Results go to stdout
whole, whatever the width: a log or a pipe never gets a line broken at 80 columns.

Third-party output (Python warnings, Transformers' and tqdm's bars, torch.onnx's logging) is
silenced unless ``-v``/``--verbose`` is given. Nothing here imports torch at module level.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import typer
from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TaskID,
    TextColumn,
)
from rich.text import Text

from ctxc.core.interrupts import pause_point

__all__ = [
    "VERBOSE",
    "Counter",
    "Trail",
    "command_trail",
    "current",
    "err",
    "finish",
    "is_verbose",
    "out",
    "progress",
    "quiet_defaults",
    "quiet_libraries",
    "say",
    "stage",
    "stage_progress",
]

err = Console(stderr=True)
out = Console()

PLAIN: dict[str, Any] = {"highlight": False, "markup": False, "soft_wrap": True}
# Set for the command's process unless --verbose: read when the libraries load (tqdm reads
# TQDM_* when it is imported; Transformers' GGUF reader draws a plain tqdm bar).
_QUIET_ENV = {"TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
_state: dict[str, Any] = {"verbose": False, "set_env": ()}
_trail: list[Trail] = []  # the command's trail, once started


class _Bar(ProgressColumn):
    """A bar once the total is known; nothing while a stage has no count (no pulsing)."""

    def __init__(self) -> None:
        super().__init__()
        self._bar = BarColumn()

    def render(self, task) -> RenderableType:
        return self._bar.render(task) if task.total is not None else Text("")


class _Count(ProgressColumn):
    """``12/18 blocks`` once the total is known; nothing before (never ``0/None``)."""

    def render(self, task) -> Text:
        if task.total is None:
            return Text("")
        unit = task.fields.get("unit", "")
        return Text(f"{int(task.completed)}/{int(task.total)}{' ' + unit if unit else ''}")


class _Rate(ProgressColumn):
    """Items per second of a counter given a ``rate`` unit (``0.25 contexts/s``)."""

    def render(self, task) -> Text:
        unit, speed = task.fields.get("rate"), task.fields.get("speed")
        return Text(f"{speed:.2f} {unit}" if unit and speed else "")


class _Elapsed(ProgressColumn):
    """Seconds since the command started, as the plain lines give them."""

    def __init__(self, start: float) -> None:
        super().__init__()
        self.start = start

    def render(self, task) -> Text:
        return Text(f"{time.perf_counter() - self.start:.0f} s", style="progress.elapsed")


class Trail:
    """A command's progress on ``console``: one rich display on a terminal, else plain lines.

    Rows are keyed: ``"activity"`` (the current stage, or the blocks of a solve) and one per
    open :class:`Counter` (contexts of a batch, generated tokens). While a counter is open, the
    plain form keeps to the counter's lines: the stages inside each item would repeat per item.
    """

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal
        self.start = time.perf_counter()
        self.counters = 0
        self.closed = False
        self._lines = 0
        self._display: Progress | None = None
        self._rows: dict[str, TaskID] = {}
        self._tenths: dict[str, int] = {}

    def stage(self, text: str, keep: bool = False) -> None:
        """Now doing ``text``. ``keep``: a line that stays on a terminal too (a long step)."""
        if self.closed:
            return
        if self.live:
            if keep:
                self.console.print(f"ctxc: {text}", **PLAIN)
            self._show("activity", text)
        elif keep or not self.counters:
            self._line(text)
        self._tenths.pop("activity", None)

    def count(self, key: str, done: int, total: int, text: str, unit: str = "", **more):
        """``done`` of ``total`` for the row ``key``.

        The plain form prints the first call, then one line per tenth of ``total`` reached.

        Args:
            more: ``detail`` (a block's path, on a terminal) and ``rate``: the unit of a rate
                shown beside the count (``contexts/s``), with ``since`` (when counting began)
                and ``skipped`` (items of ``done`` that took no work, such as the lines a
                ``--resume`` keeps: not counted in the rate).
        """
        if self.closed:
            return
        seconds = time.perf_counter() - more.get("since", self.start)
        worked = done - more.get("skipped", 0)
        speed = worked / seconds if more.get("rate") and worked > 0 and seconds > 0 else None
        if self.live:
            text = f"{text} {more.get('detail', '')}".rstrip()
            self._show(key, text, done, total, unit, more.get("rate"), speed)
            return
        if key == "activity" and self.counters:
            return
        tenth = done * 10 // max(total, 1)
        if tenth > self._tenths.get(key, -1):  # done == total is tenth 10: always shown once
            self._tenths[key] = tenth
            line = f"{text} {done}/{total}{' ' + unit if unit else ''}"
            if speed is not None:
                line += f", {speed:.2f} {more['rate']}"
            self._line(line)

    def drop(self, key: str) -> None:
        """Remove the row ``key`` (a closed counter)."""
        row = self._rows.pop(key, None)
        if row is not None and self._display is not None:
            self._display.remove_task(row)
        self._tenths.pop(key, None)

    def close(self, ok: bool) -> None:
        """Stop the display; on success, a plain trail ends with the total time. Once only."""
        if self.closed:
            return
        self.closed = True
        if self._display is not None:
            self._display.stop()
            self._display = None
        self._rows.clear()
        if ok and self._lines:
            self._line("done")

    def _line(self, text: str) -> None:
        elapsed = time.perf_counter() - self.start
        self.console.print(f"ctxc: {text} ({elapsed:.1f} s)", **PLAIN)
        self._lines += 1

    def _show(
        self, key: str, text: str, done=0, total=None, unit="", rate=None, speed=None
    ) -> None:
        if self._display is None:
            self._display = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                _Bar(),
                _Count(),
                _Rate(),
                _Elapsed(self.start),
                console=self.console,
                transient=True,
                redirect_stdout=False,  # results go to stdout, never above the display
            )
            self._display.start()
        row = self._rows.get(key)
        if row is not None and total is None:
            self._display.remove_task(row)  # a new stage: its own row, without the old count
            row = None
        if row is None:
            row = self._display.add_task(
                text, total=total, completed=done, unit=unit, rate=rate, speed=speed
            )
            self._rows[key] = row
        else:
            self._display.update(
                row, description=text, completed=done, total=total, unit=unit, speed=speed
            )


def current() -> Trail:
    """The command's trail (started on first use outside :func:`command_trail`)."""
    if not _trail:
        _trail.append(Trail(err))
    return _trail[0]


def stage(text: str, keep: bool = False) -> None:
    """Say what the command does now (see :meth:`Trail.stage`)."""
    current().stage(text, keep)


def finish(ok: bool = True) -> None:
    """End the command's trail (before its results are printed)."""
    if _trail:
        _trail.pop().close(ok)


@contextlib.contextmanager
def command_trail() -> Iterator[Trail]:
    """The trail of one command; closed however the command ends (``ctxc.cli.app._run``)."""
    finish(ok=False)
    trail = current()
    ok = False
    try:
        yield trail
        ok = True
    finally:
        if _trail and _trail[0] is trail:
            finish(ok)


def say(text) -> None:
    """Print a result on stdout whole: no wrapping at the terminal's (or COLUMNS') width.

    Args:
        text: a line (or lines), or a rich renderable (a table: its natural width off a
            terminal).

    Side effects: ends the progress trail first, so no display redraws beside the results.
    """
    finish(ok=True)
    if isinstance(text, str):
        out.print(text, **PLAIN)
    elif out.is_terminal:
        out.print(text)
    else:  # a log: the table at its natural width, whatever COLUMNS says
        from rich.measure import Measurement

        natural = Measurement.get(out, out.options.update(max_width=100_000), text).maximum
        Console(file=out.file, width=natural, color_system=None).print(text)


class Counter:
    """A ``rich.progress.Progress``-like front (``add_task``/``update``) on the command's trail.

    Counts items of a loop (contexts, generated tokens) as a row of their own; the plain form
    prints a line per tenth. ``rate``: a unit (``contexts/s``) for a rate shown with the count.
    """

    def __init__(self, rate: str | None = None) -> None:
        self.rate = rate
        self.trail = current()
        self._tasks: dict[str, dict] = {}

    def __enter__(self) -> Counter:
        self.trail.counters += 1
        return self

    def __exit__(self, *exc) -> None:
        self.trail.counters -= 1
        for key in [*self._tasks, "activity"]:  # the last item's stage is over too
            self.trail.drop(key)

    def add_task(self, description: str, total: int | None = None, unit: str = "", **_) -> str:
        """A new counted row; returns its key."""
        key = f"counter-{id(self)}-{len(self._tasks)}"
        self._tasks[key] = {"text": description, "total": total, "done": 0, "unit": unit}
        self._tasks[key].update(since=time.perf_counter(), skipped=0)
        self._show(key)
        return key

    def update(
        self, task: str, *, completed=None, advance=None, total=None, description=None, kept=False
    ):
        """Set or advance the count of ``task`` (keywords as rich's ``Progress.update``);
        ``kept``: the items advanced took no work (lines a ``--resume`` keeps): counted, not
        in the rate."""
        row = self._tasks[task]
        if kept and advance is not None:
            row["skipped"] += int(advance)
        if total is not None:
            row["total"] = total
        if description is not None:
            row["text"] = description
        if completed is not None:
            row["done"] = int(completed)
        if advance is not None:
            row["done"] += int(advance)
        self._show(task)

    def _show(self, key: str) -> None:
        row = self._tasks[key]
        if row["total"] is None:
            self.trail.stage(row["text"])
        else:
            more = {"rate": self.rate, "since": row["since"], "skipped": row["skipped"]}
            self.trail.count(key, row["done"], row["total"], row["text"], row["unit"], **more)


def progress(rate: str | None = None) -> Counter:
    """A :class:`Counter` for a command's loop (``with progress() as bar: ...``).

    Args:
        rate: the unit of a rate to show with the count (``contexts/s``), or None.
    """
    return Counter(rate)


@contextlib.contextmanager
def stage_progress(label: str, verb: str) -> Iterator[tuple[Callable, Callable]]:
    """The callbacks of a compile (or a bake): its stages and its blocks, on the trail.

    Args:
        label: the first stage (``compiling``).
        verb: what is done to each block (``solving``): ``solving 12/18 blocks``.

    Yields:
        ``(on_stage, on_block)``; ``on_stage`` is also an interrupt pause point.
    """
    trail = current()
    trail.stage(label)

    def on_stage(name: str) -> None:
        trail.stage(name)
        pause_point(name)

    def on_block(done: int, total: int, path: str) -> None:
        trail.count("activity", done, total, verb, "blocks", detail=path)

    yield on_stage, on_block


def _set_verbose(value: bool) -> bool:
    if value and not _state["verbose"]:
        _state["verbose"] = True
        for key in _state["set_env"]:
            os.environ.pop(key, None)
        _state["set_env"] = ()
        warnings.simplefilter("default")  # ahead of quiet_defaults' "ignore"
    return value


VERBOSE = typer.Option(
    False,
    "-v",
    "--verbose",
    help="Show the libraries' own warnings and progress bars (torch, Transformers).",
    callback=_set_verbose,
    is_eager=True,
    metavar="",
)


def is_verbose() -> bool:
    """Whether ``--verbose`` was given (a Ray worker is given its setup, compiler/cli/batch.py)."""
    return bool(_state["verbose"])


def quiet_defaults() -> None:
    """Before a command's libraries load: Python warnings off, Transformers' and tqdm's output
    off through their variables (kept when the user set them). ``--verbose`` undoes it.
    """
    _state["verbose"] = False
    warnings.filterwarnings("ignore")
    missing = [key for key in _QUIET_ENV if key not in os.environ]
    for key in missing:
        os.environ[key] = _QUIET_ENV[key]
    _state["set_env"] = tuple(missing)


def quiet_libraries() -> None:
    """Silence the libraries' loggers and bars once they are imported, unless ``--verbose``.

    torch is imported first: its import resets the levels of its own loggers (``torch._logging``),
    so a level set before it is lost and torch.onnx warns about torchvision once per op.
    """
    if _state["verbose"]:
        return
    import torch  # noqa: F401  (see the docstring)

    # The ONNX exporter warns per optional op library it does not find (torchvision).
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    # accelerate warns at every dispersed load that offloaded parameters are on meta: expected.
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # Loading weights, Writing model shards
