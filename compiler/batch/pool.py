"""A batch run's workers: each holds one model and runs one line at a time (issues 26, 55).

A pool's workers are Ray actors (``compiler/batch/ray_engine.py``) or processes of this machine
(``compiler/batch/processes.py``); what they share is here. Each worker is a :class:`LineWorker`:
it loads the model once and runs the run's line step (:data:`~ctxc.batch.line.Step`: a
``--contexts`` line's compile, a routed bake's chunk) into a staging folder the driver made.
The driver (this process) keeps everything else (``compiler/batch/folder.py``): it holds DIR,
creates each line's staging folder, hands lines to whichever worker is free (in any order), and
moves a finished line into place, so every line's folder is what a run in this process writes
and only the driver ever renames into DIR.

A worker that dies (killed, out of memory, its node lost) loses only the line it held: its
staging folder is removed, the line goes back to the queue for another worker, a new worker
takes the dead one's place, and the line's row says ``"attempts"``. A line whose workers die
:data:`MAX_ATTEMPTS` times is an error of that line. An interrupt ends the workers and removes
the staging folders of the lines in flight; the lines finished stay, and ``resume`` skips them.
No torch import at module level.
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from ctxc.batch.folder import Layout
from ctxc.batch.hooks import BatchHooks
from ctxc.batch.line import LineOutcome, Step
from ctxc.core.errors import CtxcError
from ctxc.core.interrupts import deferred_signals, pause_point

__all__ = [
    "KILL_WAIT_S",
    "MAX_ATTEMPTS",
    "Engine",
    "LineWorker",
    "Lost",
    "Pool",
    "Work",
    "run_pooled",
    "worker_threads",
]

MAX_ATTEMPTS = 3  # a line whose worker dies this often is that line's error, not a retry loop
KILL_WAIT_S = 30.0  # how long an interrupted run waits for its ended workers to be gone


@dataclasses.dataclass(frozen=True)
class Work:
    """What each line of a batch run is, wherever it runs.

    Attributes:
        step: the line's step (:data:`~ctxc.batch.line.Step`), a module-level function.
        opts: the step's options, handed to every worker (picklable).
        layout: DIR's :class:`~ctxc.batch.folder.Layout`.
        placement: where each model loads (a :class:`~ctxc.models.devices.Placement`); None:
            the CPU.
        split_threads: the workers share this process's torch threads (each gets
            :func:`worker_threads`); False: each takes them all (a ``--contexts`` Ray run,
            byte-identical to the run in one process at that count).
        noun: what a line is, in messages (``contexts``).
        here: the step of a line run in this process, when it differs (it may hold the
            caller's reporters: any callable); None: ``step``.
    """

    step: Step
    opts: Any
    layout: Layout = dataclasses.field(default_factory=Layout)
    placement: Any = None
    split_threads: bool = False
    noun: str = "contexts"
    here: Step | None = None


def worker_threads(budget: int, width: int, split: bool) -> int:
    """Torch threads of each of ``width`` workers: ``budget`` (this process's count) split
    between them when ``split`` (at least 1 each), else ``budget`` for each."""
    return max(1, budget // max(1, width)) if split else budget


class LineWorker:
    """One worker's model, loaded once; runs lines into staging folders the driver made.

    Wrapped by ``ray.remote`` for a Ray run; built in each worker process of a local one.
    """

    def __init__(
        self, model, dtype: str, placement, threads: int, env: dict, hooks: BatchHooks, step: Step
    ) -> None:
        """Load the model; a CtxcError is kept for :meth:`ready` (the driver says it).

        Args:
            threads: torch's intra-op threads (:func:`worker_threads`): the count decides the
                rounding of every parallel sum, so a line's folder is byte-identical to one
                run in a process at that count.
            env: the driver's test-hook variables (``TEST_HOOKS``): a worker of a Ray
                started earlier has that Ray's environment, not the driver's.
            hooks: the run's ``load``, ``setup`` and ``name_of`` (:func:`worker_hooks`).
            step: the line's step.
        """
        import torch

        os.environ.update(env)
        if hooks.setup is not None:
            hooks.setup()  # this process never ran the caller's setup (the CLI: quiet libraries)
        torch.set_num_threads(threads)
        self.name_of = hooks.name_of
        self.step = step
        self.net = self.tokenizer = None
        self.problem: str | None = None
        try:
            self.net, self.tokenizer = hooks.load(model, dtype, placement)
        except CtxcError as exc:  # said by the driver in one line, as the local run does
            self.problem = " ".join(str(exc).split())

    def ready(self) -> tuple[dict | None, str | None, int]:
        """(the model's fingerprint, or None and why it did not load; this process's pid)."""
        if self.problem is not None or self.net is None:
            return None, self.problem or "the model did not load", os.getpid()
        from ctxc.models.fingerprint import fingerprint

        return fingerprint(self.net), None, os.getpid()

    def run(self, staging: str, entry: dict, opts) -> LineOutcome:
        """Run ``entry`` into ``staging`` with the run's step."""
        import socket

        pause_point(f"running {entry['name']}")
        if not Path(staging).is_dir():  # the driver made it: DIR is not shared with this node
            unseen = CtxcError().naming(
                "the output folder is not visible on {}: with {engine} ray, {out} must be on a "
                "path every worker sees",
                socket.gethostname(),
            )
            return LineOutcome("error", unseen.render(self.name_of))
        return self.step(self.net, self.tokenizer, Path(staging), entry, opts, self.name_of)


def worker_hooks(hooks: BatchHooks) -> BatchHooks:
    """What a worker needs of the run's hooks (a worker is sent them: the callbacks that report
    stay in this process); its load is ``worker_load`` when given."""
    load = hooks.worker_load or hooks.load
    return BatchHooks(load=load, setup=hooks.setup, name_of=hooks.name_of)


@dataclasses.dataclass(frozen=True)
class Lost:
    """A worker gone while it held a line (its process killed, its node lost).

    Attributes:
        cause: what the engine said, on one line.
    """

    cause: str


class Pool:
    """The workers of a run, a line in flight on each; a dead one replaced by a new one.

    The engines give the transport (:meth:`_new`, :meth:`_ready`, :meth:`_submit`,
    :meth:`_wait`, :meth:`_result`, :meth:`_end`, :meth:`_gone`); the dispatch is here.
    """

    def __init__(self, width: int, hooks: BatchHooks, work: Work) -> None:
        self.hooks = hooks
        self.work = work
        self.workers = [self._new() for _ in range(width)]
        self.pids: dict = {}
        self.flight: dict = {}  # key -> (worker, line index, staging folder)

    def _new(self):
        """Start one worker (its model loads in the background)."""
        raise NotImplementedError

    def _ready(self, workers: list) -> list[tuple]:
        """Wait for ``workers``' models: each one's :meth:`LineWorker.ready`."""
        raise NotImplementedError

    def _submit(self, worker, staging: Path, entry: dict):
        """Hand ``worker`` a line; the key :meth:`_wait` names it by."""
        raise NotImplementedError

    def _wait(self):
        """The key of a line in flight that ended (an interrupt propagates)."""
        raise NotImplementedError

    def _result(self, key) -> LineOutcome | Lost:
        """How the line of ``key`` ended (:class:`Lost` when its worker is gone)."""
        raise NotImplementedError

    def _end(self) -> None:
        """Ask every worker to end now."""
        raise NotImplementedError

    def _gone(self, keys: list, timeout: float) -> None:
        """Wait up to ``timeout`` s for the workers of ``keys`` to be gone."""
        raise NotImplementedError

    def start(self) -> dict:
        """Wait for every worker's model; its fingerprint (a CtxcError when one failed)."""
        ready = self._ready(self.workers)
        for worker, (_, problem, pid) in zip(self.workers, ready, strict=True):
            self.pids[worker] = pid
            if problem is not None:
                raise CtxcError(problem)
        return ready[0][0]

    def drain(self, queue: deque, folder, lines, rows: list[dict], done: int) -> None:
        """Hand out the queued lines until every one is settled (see the module docstring).

        Args:
            queue: indices into ``lines`` of the lines to run.
            folder: the run's :class:`~ctxc.batch.folder.BatchFolder`.
            lines: :func:`~ctxc.batch.lines.read_lines`'s lines; ``rows``: their rows.
            done: the lines settled already (kept by ``resume``).
        """
        from ctxc.batch.folder import input_digest
        from ctxc.batch.line import record, settle

        idle = list(self.workers)
        attempts: dict[int, list[str]] = {}
        while queue or self.flight:
            while idle and queue:
                i = queue.popleft()
                worker, entry = idle.pop(), lines[i][1]
                staging = folder.staging(entry["name"])
                self.flight[self._submit(worker, staging, entry)] = (worker, i, staging)
                attempts.setdefault(i, [])
            key = self._wait()
            worker, i, staging = self.flight.pop(key)
            n, entry, _ = lines[i]
            try:
                got = self._result(key)
            except BaseException:  # an interrupt, or an error that escaped the line's step
                folder.discard(staging)
                raise
            if isinstance(got, Lost):  # the worker's process is gone
                folder.discard(staging)  # the dead worker's half-written line
                attempts[i].append(f"worker pid {self.pids.get(worker)} lost: {got.cause}")
                idle.append(self._replace(worker))
                if len(attempts[i]) < MAX_ATTEMPTS:
                    queue.appendleft(i)  # first in line again: another worker takes it
                    continue
                got = LineOutcome("error", f"its worker died {MAX_ATTEMPTS} times")
            else:
                idle.append(worker)
            digest = input_digest(entry)
            settled = settle(folder, staging, entry, digest, got, self.hooks.name_of)
            lost = attempts[i]
            extra = {"attempts": len(lost) + 1, "workers_lost": lost} if lost else {}
            record(rows, i, (n, entry), settled, self.hooks.on_error, **extra)
            folder.write_index(rows)
            done += 1
            self.hooks.on_lines(done, len(lines), False)
            pause_point(f"line {n} done")

    def _replace(self, dead):
        """A new worker in place of ``dead`` (its model loaded before it takes a line)."""
        fresh = self._new()
        self.workers[self.workers.index(dead)] = fresh
        [(_, problem, pid)] = self._ready([fresh])
        if problem is not None:
            raise CtxcError(problem)
        self.pids[fresh] = pid
        return fresh

    def close(self, folder) -> None:
        """End every worker and remove the staging folders of the lines still in flight.

        A worker asked to end may still be writing; a line's staging folder is removed only
        once its worker is gone (a worker still writing would make it again).
        """
        self._end()
        with deferred_signals():  # a second Ctrl-C does not cut the cleanup short
            if self.flight:
                self._gone(list(self.flight), KILL_WAIT_S)
            for _, _, staging in self.flight.values():
                folder.discard(staging)
        self.flight.clear()


class Engine(Protocol):
    """Where a batch run's lines go when not in this process (a Ray cluster, worker
    processes)."""

    def in_process(self, lines: int) -> bool:
        """Whether ``lines`` lines are better run in this process (a pool of one)."""
        ...

    def session(self, hooks: BatchHooks) -> AbstractContextManager[Callable[..., Pool]]:
        """What the pools of a run need (a Ray connection); yields ``make(model, work,
        lines, hooks)``, a started pool of at most ``lines`` workers."""
        ...


def run_pooled(
    engine: Engine, model: tuple, folder, lines, rows: list[dict], work: Work, hooks: BatchHooks
) -> None:
    """Run ``lines`` on ``engine``'s workers, updating ``rows`` and the index after each line.

    Args:
        engine: the pool's engine.
        model: ``(model, dtype)``.
        folder: the run's :class:`~ctxc.batch.folder.BatchFolder` (held here).
        lines: :func:`~ctxc.batch.lines.read_lines`'s lines; ``rows``: their rows.
        work: the lines' step and options.
        hooks: the run's callbacks (``load``, ``setup`` and ``name_of`` go to each worker).

    Side effects:
        starts and ends the workers; writes DIR as a run in this process does.
    """
    from ctxc.batch.folder import input_digest
    from ctxc.batch.line import record

    queue: deque[int] = deque()
    done = 0
    hooks.on_lines(0, len(lines), False)
    for i, (n, entry, problem) in enumerate(lines):
        kept = None if entry is None else folder.finished(entry["name"], input_digest(entry))
        if entry is not None and kept is None:
            queue.append(i)
            continue
        record(rows, i, (n, entry), (problem, kept), hooks.on_error)
        done += 1
        hooks.on_lines(done, len(lines), True)  # kept (resume): not in the rate
    if not queue:
        folder.write_index(rows)
        return
    with engine.session(hooks) as make:
        pool = None
        try:
            pool = make(model, work, len(queue), hooks)
            folder.check_model(pool.start())
            folder.write_index(rows)
            hooks.on_workers(len(pool.workers))
            pool.drain(queue, folder, lines, rows, done)
        finally:
            if pool is not None:
                pool.close(folder)
