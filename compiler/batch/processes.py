"""A batch run on this machine's cores (``ctxc bake --route --workers N``): the lines run by
worker processes, one model each (issue 55).

The pool and its dispatch are ``compiler/batch/pool.py``'s, as on Ray; this module is their
transport on local processes. Each worker is a new Python process (``spawn``: nothing of this
one's torch threads or locks is inherited), holding a :class:`~ctxc.batch.pool.LineWorker` and
a pipe: it loads the model once, then runs the lines it is sent one at a time. A worker ignores
Ctrl-C (the driver ends it) and ends itself when the driver's process is gone. A worker killed
in a line costs that line a retry on a new worker, as on Ray.

The pool is as wide as :class:`LocalEngine` says, and each worker computes with its share of this
process's torch threads (:func:`~ctxc.batch.pool.worker_threads`): the count decides how every
parallel sum is rounded, so a line is byte-identical to one run in one process at that count.
No torch import at module level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ctxc.batch.hooks import BatchHooks
from ctxc.batch.pool import (
    KILL_WAIT_S,
    LineWorker,
    Lost,
    Pool,
    Work,
    worker_hooks,
    worker_threads,
)
from ctxc.core.errors import CtxcError, OptionError
from ctxc.core.interrupts import TEST_HOOKS

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

__all__ = ["LocalEngine", "ProcessPool", "available_memory"]


def available_memory() -> int | None:
    """Bytes of memory this machine can give new processes now (Linux's ``MemAvailable``), or
    None when it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclasses.dataclass(frozen=True)
class LocalEngine:
    """How wide a run on this machine's worker processes goes (``engine="local"``).

    Attributes:
        workers: the number of worker processes; 1: every line in this process, one model
            load; None: as many as this process's torch threads (``--threads``,
            ``OMP_NUM_THREADS``, else one a core) and, with ``memory_per_worker``, the memory
            available now hold, at most one per line.
        memory_per_worker: the bytes one worker is expected to hold at its peak, or None.
    """

    workers: int | None = None
    memory_per_worker: int | None = None

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise OptionError("{workers} must be at least 1, not {}", self.workers)

    def width(self, lines: int) -> int:
        """The workers for ``lines`` lines to run (at least 1)."""
        if self.workers is not None:
            return max(1, min(self.workers, lines))
        import torch

        fit = torch.get_num_threads()
        free = available_memory()
        if self.memory_per_worker and free is not None:
            fit = min(fit, free // self.memory_per_worker)
        return max(1, min(fit, lines))

    def in_process(self, lines: int) -> bool:
        """Whether ``lines`` lines run in this process (a pool of one worker)."""
        return self.width(lines) == 1

    @contextlib.contextmanager
    def session(self, hooks: BatchHooks) -> Iterator:
        """Nothing to join: yields the pool's maker (``make(model, work, lines, hooks)``)."""

        def make(model: tuple, work: Work, lines: int, hooks: BatchHooks) -> ProcessPool:
            return ProcessPool(model, work, self.width(lines), hooks)

        yield make


@dataclasses.dataclass(eq=False)  # each worker its own key (the pool's maps)
class _Worker:
    """A worker process and the driver's end of its pipe."""

    process: BaseProcess
    conn: Connection


class ProcessPool(Pool):
    """The worker processes of a run (:class:`~ctxc.batch.pool.Pool`'s transport here)."""

    def __init__(self, model: tuple, work: Work, width: int, hooks: BatchHooks) -> None:
        import multiprocessing

        import torch

        self.context = multiprocessing.get_context("spawn")
        threads = worker_threads(torch.get_num_threads(), width, work.split_threads)
        env = {k: os.environ[k] for k in TEST_HOOKS if k in os.environ}
        self.args = (*model, work.placement, threads, env, worker_hooks(hooks), work.step)
        self.opts = work.opts
        hooks.on_stage(f"loading the model in {width} worker processes", False)
        self.loaded: set[_Worker] = set()  # the workers whose model is in (they read a pipe)
        super().__init__(width, hooks, work)

    def _new(self) -> _Worker:
        ours, theirs = self.context.Pipe()
        process = self.context.Process(target=_serve, args=(theirs, self.args), daemon=True)
        # Started with Ctrl-C ignored (a new Python keeps SIGINT ignored): the driver alone
        # hears it and ends the workers, none prints a traceback of its own. (Only the main
        # thread may set a handler; a run from another thread hears no Ctrl-C itself.)
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            process.start()
        finally:
            if main:
                signal.signal(signal.SIGINT, old)
        theirs.close()
        return _Worker(process, ours)

    def _ready(self, workers: list) -> list[tuple]:
        got = []
        for worker in workers:
            try:
                got.append(worker.conn.recv())
                self.loaded.add(worker)
            except (EOFError, OSError):
                worker.process.join(5)
                raise CtxcError(
                    f"a worker process ended while loading the model ({_ended(worker)})"
                ) from None
        return got

    def _submit(self, worker, staging: Path, entry: dict):
        worker.conn.send((str(staging), entry, self.opts))
        return worker  # one line at a time: the worker names its line

    def _wait(self):
        from multiprocessing.connection import wait

        busy = [worker for worker, _, _ in self.flight.values()]
        ready = set(wait([w.conn for w in busy] + [w.process.sentinel for w in busy]))
        return next(w for w in busy if w.conn in ready or w.process.sentinel in ready)

    def _result(self, key):
        try:
            if key.conn.poll():  # its answer came, even if the process ended since
                return key.conn.recv()
        except (EOFError, OSError):
            pass
        key.process.join(5)
        return Lost(f"its process ended ({_ended(key)})")

    def _end(self) -> None:
        busy = {worker for worker, _, _ in self.flight.values()}
        for worker in self.workers:
            if (worker in busy or worker not in self.loaded) and worker.process.is_alive():
                worker.process.terminate()  # SIGTERM: the worker exits (:func:`_serve`)
            worker.conn.close()  # an idle worker reads the end of its pipe and returns

    def _gone(self, keys: list, timeout: float) -> None:
        for worker in keys:
            _reap(worker, timeout)

    def close(self, folder) -> None:
        """End every worker (:meth:`Pool.close`), then wait for them all to be gone."""
        super().close(folder)
        for worker in self.workers:
            _reap(worker, KILL_WAIT_S)


def _reap(worker: _Worker, timeout: float) -> None:
    """Wait up to ``timeout`` s for ``worker`` to end; then SIGTERM, then SIGKILL it."""
    worker.process.join(timeout)
    for end in (worker.process.terminate, worker.process.kill):
        if not worker.process.is_alive():
            return
        end()
        worker.process.join(5)


def _ended(worker: _Worker) -> str:
    """How a worker's process ended, in words."""
    code = worker.process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _serve(conn, args: tuple) -> None:
    """A worker process: load the model, say so, then run each line sent until the pipe
    closes.

    Args:
        conn: this end of the pipe.
        args: :class:`~ctxc.batch.pool.LineWorker`'s arguments.
    """
    # SIGTERM (the driver ending a worker in a line) as an exit: Python's cleanup runs, so no
    # semaphore a library made is left to the resource tracker's warning.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    _end_with_parent()
    worker = LineWorker(*args)
    conn.send(worker.ready())
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(worker.run(*task))


def _end_with_parent() -> None:
    """End this process as soon as the driver's is gone (killed: no one would end us)."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
