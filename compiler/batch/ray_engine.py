"""A batch run on Ray (``ctxc compile --contexts FILE.jsonl --engine ray``): the lines compiled
by a Ray actor pool.

Each worker is a Ray actor that loads and traces the model once (through the export cache,
``compiler/store/export_cache.py``: with ``CTXC_CACHE`` on a shared path, one trace serves every
worker) and compiles one line at a time with the local run's own per-line step
(:func:`ctxc.batch.line.compile_line`). The driver (this process) keeps everything else of the
local run (``compiler/batch/folder.py``): it holds DIR, creates each line's staging folder,
hands lines to whichever worker is free (in any order), and moves a finished line into place, so
every line's folder is what the local run writes and only the driver ever renames into DIR.
DIR must therefore be on a path every worker sees (one machine, or a shared file system).

A worker that dies (killed, out of memory, its node lost) loses only the line it held: its
staging folder is removed, the line goes back to the queue for another worker, a new worker
takes the dead one's place, and the line's row in index.json says ``"attempts"``. A line whose
workers die :data:`MAX_ATTEMPTS` times is an error of that line. Ctrl-C kills the workers and
removes the staging folders; the lines finished stay, and ``resume`` skips them. Messages name
the library's parameters (``workers``); the CLI prints its flags (``--workers``).

``ray`` is an optional extra (``ctxc[ray]``), imported only here and only when asked for.
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from pathlib import Path

from ctxc.batch.hooks import BatchHooks
from ctxc.core.errors import CtxcError, OptionError
from ctxc.core.interrupts import TEST_HOOKS, deferred_signals, pause_point

__all__ = [
    "KILL_WAIT_S",
    "MAX_ATTEMPTS",
    "LineWorker",
    "RayEngine",
    "quiet_ray_notices",
    "require_ray",
    "run_on_ray",
]

# Ray's own notice when the local cluster it starts uses token authentication (a warning that
# says nothing wrong, on every run; issue 34). ``-v`` lets it through.
_RAY_NOTICES = ("Token authentication is enabled for this Ray cluster",)


class _DropNotices:
    """A logging filter that drops Ray's :data:`_RAY_NOTICES` (every other record passes)."""

    def filter(self, record) -> bool:
        return not str(record.getMessage()).startswith(_RAY_NOTICES)


def quiet_ray_notices() -> None:
    """Drop Ray's token-authentication notice from its logger; its warning that authentication
    is *disabled* still shows. Side effects: a filter on Ray's authentication logger, installed
    once."""
    import logging

    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DropNotices) for f in logger.filters):
        logger.addFilter(_DropNotices())


MAX_ATTEMPTS = 3  # a line whose worker dies this often is that line's error, not a retry loop
KILL_WAIT_S = 30.0  # how long an interrupted run waits for its killed workers to be gone


@dataclasses.dataclass(frozen=True)
class RayEngine:
    """Where and how wide a Ray run goes (``engine="ray"``).

    Attributes:
        address: the cluster (``ray.init(address=...)``: ``auto``, ``ray://host:10001``...);
            None: a Ray already initialised in this process, else a local one.
        workers: the number of workers; None: as many as the cluster's CPUs (or GPUs, with
            ``gpus_per_worker``) allow, at most one per line to compile.
        gpus_per_worker: GPUs each worker reserves (its model goes on ``cuda``); 0: CPU.
        cpus_per_worker: CPUs each worker reserves.
    """

    address: str | None = None
    workers: int | None = None
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0

    def __post_init__(self) -> None:
        if self.workers is not None and self.workers < 1:
            raise OptionError("{workers} must be at least 1, not {}", self.workers)
        if self.gpus_per_worker < 0:
            raise OptionError("{gpus_per_worker} must be 0 or more, not {}", self.gpus_per_worker)
        if self.cpus_per_worker <= 0:
            raise OptionError("{cpus_per_worker} must be more than 0, not {}", self.cpus_per_worker)


def require_ray():
    """The ``ray`` module; a CtxcError naming the extra when it is not installed."""
    try:
        import ray
    except ImportError:
        raise CtxcError().naming("{engine} ray needs ray: pip install 'ctxc[ray]'") from None
    return ray


class LineWorker:
    """One worker's model, loaded once; compiles lines into staging folders the driver made.

    Wrapped by ``ray.remote`` when a run starts (this module imports no ray at load).
    """

    def __init__(
        self, model, dtype: str, placement, threads: int, env: dict, hooks: BatchHooks
    ) -> None:
        """Load the model; a CtxcError is kept for :meth:`ready` (the driver says it).

        Args:
            threads: torch's intra-op threads: the local run's, as the count decides the
                rounding of every parallel sum, so the folders are byte-identical to it.
            env: the driver's test-hook variables (``TEST_HOOKS``): a worker of a Ray
                started earlier has that Ray's environment, not the driver's.
            hooks: the run's ``load``, ``setup`` and ``name_of`` (:func:`_worker_hooks`).
        """
        import torch

        os.environ.update(env)
        if hooks.setup is not None:
            hooks.setup()  # this process never ran the caller's setup (the CLI: quiet libraries)
        torch.set_num_threads(threads)
        self.name_of = hooks.name_of
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

    def compile(self, staging: str, entry: dict, opts):
        """Compile ``entry`` into ``staging`` (:func:`ctxc.batch.line.compile_line`)."""
        import socket

        from ctxc.batch.line import LineOutcome, compile_line

        pause_point(f"compiling {entry['name']}")
        if not Path(staging).is_dir():  # the driver made it: DIR is not shared with this node
            unseen = CtxcError().naming(
                "the output folder is not visible on {}: with {engine} ray, {out} must be on a "
                "path every worker sees",
                socket.gethostname(),
            )
            return LineOutcome("error", unseen.render(self.name_of))
        return compile_line(self.net, self.tokenizer, Path(staging), entry, opts, self.name_of)


def run_on_ray(
    engine: RayEngine, model: tuple, folder, lines, rows: list[dict], opts, hooks: BatchHooks
) -> None:
    """Compile ``lines`` on Ray workers, updating ``rows`` and index.json after each line.

    Args:
        engine: the cluster and the pool's size.
        model: ``(model, dtype)`` as given to ``ctxc.compile_many``.
        folder: the run's :class:`~ctxc.batch.folder.BatchFolder` (held here).
        lines: :func:`~ctxc.batch.lines.read_lines`'s lines; ``rows``: index.json's rows.
        opts: the run's :class:`~ctxc.batch.job.CompileJob`.
        hooks: the run's callbacks (``load``, ``setup`` and ``name_of`` go to each worker).

    Side effects:
        starts a local Ray (shut down at the end) unless one is initialised or ``address``
        is given; starts and ends the workers; writes DIR as the local run does.
    """
    from ctxc.batch.folder import input_digest
    from ctxc.batch.line import record

    ray = require_ray()
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
    started = _connect(ray, engine, hooks)
    pool = None
    try:
        width = _width(ray, engine, hooks)
        pool = _Pool(ray, engine, model, opts, min(len(queue), width), hooks)
        folder.check_model(pool.start())
        folder.write_index(rows)
        pool.drain(queue, folder, lines, rows, done)
    finally:
        if pool is not None:
            pool.close(folder)
        if started:
            ray.shutdown()


def _connect(ray, engine: RayEngine, hooks: BatchHooks) -> bool:
    """Join ``engine.address`` (or start a local Ray); True when this call started it."""
    if ray.is_initialized():
        return False
    env = {k: os.environ[k] for k in ("CTXC_CACHE", "HF_HOME") if k in os.environ}
    if hooks.quiet_ray:
        quiet_ray_notices()
    try:
        ray.init(
            address=engine.address,
            runtime_env={"env_vars": env} if env else None,
            log_to_driver=False,  # a worker's own progress lines: the driver shows the bar
            include_dashboard=False,
            configure_logging=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise CtxcError().naming("{engine} ray: cannot reach the Ray cluster: {}", exc) from None
    return True


def _width(ray, engine: RayEngine, hooks: BatchHooks) -> int:
    """The pool's size: ``workers``, else what the cluster's CPUs (or GPUs) hold, at most
    what it holds now (a worker that never gets its CPU or GPU would hold its line forever).

    Raises:
        CtxcError: the cluster has fewer GPUs than one worker asks for.
    """
    have = ray.cluster_resources()
    fit = int(have.get("CPU", 0) // engine.cpus_per_worker)
    if engine.gpus_per_worker > 0:
        fit = min(fit, int(have.get("GPU", 0) // engine.gpus_per_worker))
        if fit < 1:
            raise CtxcError().naming(
                "{gpus_per_worker} {:g}: the Ray cluster has {:g} GPUs",
                engine.gpus_per_worker,
                have.get("GPU", 0),
            )
    fit = max(1, fit)
    if engine.workers is not None and engine.workers > fit:
        notice = CtxcError().naming(
            "{workers} {}: the Ray cluster holds {}; using {}", engine.workers, fit, fit
        )
        hooks.on_stage(notice.render(hooks.name_of), True)
    return fit if engine.workers is None else min(engine.workers, fit)


class _Pool:
    """The workers of a run, a line in flight on each; a dead one replaced by a new one."""

    def __init__(
        self, ray, engine: RayEngine, model: tuple, opts, width: int, hooks: BatchHooks
    ) -> None:
        self.ray = ray
        self.hooks = hooks
        placement = opts.placement
        if engine.gpus_per_worker > 0 and (placement is None or placement.device is None):
            from ctxc.models.devices import Placement

            placement = Placement(device="cuda")  # the GPU Ray gave this worker
        import torch

        # Ray starts a worker with one thread per reserved CPU; the local run uses torch's
        # default here (OMP_NUM_THREADS, else the cores), and the count changes the bytes.
        env = {k: os.environ[k] for k in TEST_HOOKS if k in os.environ}
        self.args = (*model, placement, torch.get_num_threads(), env, _worker_hooks(hooks))
        self.opts = dataclasses.replace(opts, placement=placement)
        self.remote = ray.remote(LineWorker).options(
            num_cpus=engine.cpus_per_worker, num_gpus=engine.gpus_per_worker
        )
        self.workers = [self.remote.remote(*self.args) for _ in range(width)]
        self.pids: dict = {}
        self.flight: dict = {}  # ObjectRef -> (worker, line index, staging folder)

    def start(self) -> dict:
        """Wait for every worker's model; its fingerprint (a CtxcError when one failed)."""
        ready = self.ray.get([w.ready.remote() for w in self.workers])
        for worker, (_, problem, pid) in zip(self.workers, ready, strict=True):
            self.pids[worker] = pid
            if problem is not None:
                raise CtxcError(problem)
        return ready[0][0]

    def drain(self, queue: deque, folder, lines, rows: list[dict], done: int) -> None:
        """Hand out the queued lines until every one is settled (see the module docstring).

        Args:
            done: the lines settled already (kept by ``resume``).
        """
        from ctxc.batch.folder import input_digest
        from ctxc.batch.line import LineOutcome, record, settle

        idle = list(self.workers)
        attempts: dict[int, list[str]] = {}
        while queue or self.flight:
            while idle and queue:
                i = queue.popleft()
                worker, entry = idle.pop(), lines[i][1]
                staging = folder.staging(entry["name"])
                self.flight[worker.compile.remote(str(staging), entry, self.opts)] = (
                    worker,
                    i,
                    staging,
                )
                attempts.setdefault(i, [])
            [ref], _ = self.ray.wait(list(self.flight), num_returns=1)
            worker, i, staging = self.flight.pop(ref)
            n, entry, _ = lines[i]
            try:
                outcome = self.ray.get(ref)
                idle.append(worker)
            except self.ray.exceptions.RayActorError as exc:  # the worker's process is gone
                folder.discard(staging)  # the dead worker's half-written line
                attempts[i].append(f"worker pid {self.pids.get(worker)} lost: {_cause(exc)}")
                idle.append(self._replace(worker))
                if len(attempts[i]) < MAX_ATTEMPTS:
                    queue.appendleft(i)  # first in line again: another worker takes it
                    continue
                outcome = LineOutcome("error", f"its worker died {MAX_ATTEMPTS} times")
            except BaseException:  # an interrupt, or an error that escaped the line's step
                folder.discard(staging)
                raise
            digest = input_digest(entry)
            settled = settle(folder, staging, entry, digest, outcome, self.hooks.name_of)
            lost = attempts[i]
            extra = {"attempts": len(lost) + 1, "workers_lost": lost} if lost else {}
            record(rows, i, (n, entry), settled, self.hooks.on_error, **extra)
            folder.write_index(rows)
            done += 1
            self.hooks.on_lines(done, len(lines), False)
            pause_point(f"line {n} done")

    def _replace(self, dead):
        """A new worker in place of ``dead`` (its model loaded before it takes a line)."""
        fresh = self.remote.remote(*self.args)
        self.workers[self.workers.index(dead)] = fresh
        _, problem, pid = self.ray.get(fresh.ready.remote())
        if problem is not None:
            raise CtxcError(problem)
        self.pids[fresh] = pid
        return fresh

    def close(self, folder) -> None:
        """End every worker and remove the staging folders of the lines still in flight.

        ``ray.kill`` only asks; a line's task fails once its worker's process is gone, and
        only then is its staging folder removed (a worker still writing would make it again).
        """
        for worker in self.workers:
            self.ray.kill(worker, no_restart=True)
        with deferred_signals():  # a second Ctrl-C does not cut the cleanup short
            if self.flight:
                refs = list(self.flight)
                self.ray.wait(refs, num_returns=len(refs), timeout=KILL_WAIT_S)
            for _, _, staging in self.flight.values():
                folder.discard(staging)
        self.flight.clear()


def _worker_hooks(hooks: BatchHooks) -> BatchHooks:
    """What a worker needs of the run's hooks (a Ray worker is sent them: the callbacks that
    report stay in this process)."""
    return BatchHooks(load=hooks.load, setup=hooks.setup, name_of=hooks.name_of)


def _cause(exc: BaseException) -> str:
    """The first line of a Ray actor error (the rest is Ray's advice and a traceback)."""
    text = " ".join(str(exc).split("\n")[0].split())
    return text[:200] or type(exc).__name__
