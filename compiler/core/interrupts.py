"""Signals: SIGTERM as an interrupt, cleanup that a second Ctrl-C cannot cut short, test pauses.

Kept free of torch and Transformers imports: the CLI installs it before anything heavy loads.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = [
    "TEST_HOOKS",
    "deferred_signals",
    "install_handlers",
    "interrupt_note",
    "note_interrupt",
    "pause_point",
    "received",
]

# The test hooks' variables: a Ray worker (compiler/batch/ray_engine.py) is given them too.
TEST_HOOKS = ("CTXC_TEST_PAUSE_AT", "CTXC_TEST_PAUSE_ONCE")

_RECEIVED: list[int] = []
# What an interrupted command kept, said after ``ctxc: interrupted`` (a batch's finished lines).
_NOTE: list[str] = []


def install_handlers() -> Callable[[], None]:
    """Make SIGTERM raise KeyboardInterrupt like SIGINT, so both take the same cleanup path.

    Returns:
        a function that restores the previous handlers (``main`` may run inside a test).
    """
    _RECEIVED.clear()
    _NOTE.clear()
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(signum: int, _frame) -> None:
        _RECEIVED.append(signum)
        raise KeyboardInterrupt

    for sig in old:
        signal.signal(sig, on_signal)

    def restore() -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)

    return restore


def note_interrupt(note: str) -> None:
    """Say ``note`` with the interrupt's line: ``ctxc: interrupted; NOTE``."""
    _NOTE[:] = [note]


def interrupt_note() -> str | None:
    """The note of :func:`note_interrupt`, or None."""
    return _NOTE[0] if _NOTE else None


def received() -> int:
    """The first signal the handlers saw (``SIGINT`` when none was recorded)."""
    return _RECEIVED[0] if _RECEIVED else int(signal.SIGINT)


@contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the body (a cleanup); they are delivered when it ends."""
    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def pause_point(stage: str) -> None:
    """Test hook: with ``CTXC_TEST_PAUSE_AT=stage``, say so on stderr and wait to be signalled.

    The interrupt tests use it to send SIGINT at a known stage (loading, converting, solving,
    writing, placing, ``line N done``, a Ray worker's ``compiling NAME``) instead of guessing
    with timers; SIGUSR1 lets the run go on (the race tests hold two runs at ``placing`` and
    release them together). Without a signal it goes on after 120 s. With
    ``CTXC_TEST_PAUSE_ONCE=FILE`` only the first process to create FILE pauses, and FILE holds
    its pid (the Ray tests kill the one worker that holds a line, and its retry goes on).
    """
    if os.environ.get("CTXC_TEST_PAUSE_AT") != stage or not _first_to_pause():
        return
    # A Python handler, not a blocked signal: the signal may land on any of torch's threads,
    # and Python runs its handler on the main thread, here.
    went_on: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, _frame: went_on.append(signum))
    try:
        sys.stderr.write(f"ctxc-test: paused at {stage}\n")
        sys.stderr.flush()
        deadline = time.monotonic() + 120
        while not went_on and time.monotonic() < deadline:
            time.sleep(0.05)  # SIGINT and SIGTERM raise KeyboardInterrupt here
    finally:
        signal.signal(signal.SIGUSR1, old)


def _first_to_pause() -> bool:
    """False when ``CTXC_TEST_PAUSE_ONCE`` names a file another process created first."""
    once = os.environ.get("CTXC_TEST_PAUSE_ONCE")
    if not once:
        return True
    try:
        fd = os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    # One write of a whole line: a reader waits for the newline.
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")
    return True
