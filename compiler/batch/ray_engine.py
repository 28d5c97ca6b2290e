"""A batch run on Ray (``ctxc compile --contexts FILE.jsonl --engine ray``, ``ctxc bake --route
--engine ray``): the lines run by a Ray actor pool.

Each worker is a Ray actor (a :class:`~ctxc.batch.pool.LineWorker`) that loads and traces the
model once (through the export cache, ``compiler/store/export_cache.py``: with ``CTXC_CACHE`` on
a shared path, one trace serves every worker) and runs one line at a time with the local run's
own per-line step (:func:`ctxc.batch.line.compile_line`, a routed bake's chunk). The dispatch,
the driver's part, a dead worker's replacement and an interrupt are the pool's
(``compiler/batch/pool.py``); this module is its transport on Ray. The driver holds DIR and alone
renames into it, so DIR must be on a path every worker sees (one machine, or a shared file
system). Ctrl-C kills the workers (``ray.kill``). Messages name the library's parameters
(``workers``); the CLI prints its flags (``--workers``).

``ray`` is an optional extra (``ctxc[ray]``), imported only here and only when asked for.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ctxc.batch.hooks import BatchHooks
from ctxc.batch.pool import LineWorker, Lost, Pool, Work, worker_hooks, worker_threads
from ctxc.core.errors import CtxcError, OptionError
from ctxc.core.interrupts import TEST_HOOKS

__all__ = ["RayEngine", "RayPool", "quiet_ray_notices", "require_ray"]

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

    def in_process(self, lines: int) -> bool:
        """Never: a Ray run's lines go to its workers, however few."""
        return False

    def session(self, hooks: BatchHooks) -> _Session:
        """The run's Ray connection (:class:`_Session`)."""
        return _Session(self, hooks)


def require_ray():
    """The ``ray`` module; a CtxcError naming the extra when it is not installed."""
    try:
        import ray
    except ImportError:
        raise CtxcError().naming("{engine} ray needs ray: pip install 'ctxc[ray]'") from None
    return ray


class _Session:
    """A Ray connection for a run's pool: joined (or a local Ray started) on entry, a Ray this
    run started shut down on exit."""

    def __init__(self, engine: RayEngine, hooks: BatchHooks) -> None:
        self.engine = engine
        self.hooks = hooks
        self.ray = require_ray()
        self.started = False

    def __enter__(self):
        self.started = _connect(self.ray, self.engine, self.hooks)
        return self.make

    def __exit__(self, *exc) -> None:
        if self.started:
            self.ray.shutdown()

    def make(self, model: tuple, work: Work, lines: int, hooks: BatchHooks) -> RayPool:
        """A pool of at most ``lines`` workers, as wide as :func:`_width` allows."""
        width = min(lines, _width(self.ray, self.engine, hooks))
        return RayPool(self.ray, self.engine, model, work, width, hooks)


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


class RayPool(Pool):
    """The Ray actors of a run (:class:`~ctxc.batch.pool.Pool`'s transport on Ray)."""

    def __init__(
        self, ray, engine: RayEngine, model: tuple, work: Work, width: int, hooks: BatchHooks
    ) -> None:
        self.ray = ray
        placement = work.placement
        if engine.gpus_per_worker > 0 and (placement is None or placement.device is None):
            from ctxc.models.devices import Placement

            placement = Placement(device="cuda")  # the GPU Ray gave this worker
        import torch

        # Ray starts a worker with one thread per reserved CPU; the local run uses torch's
        # default here (OMP_NUM_THREADS, else the cores), and the count changes the bytes.
        threads = worker_threads(torch.get_num_threads(), width, work.split_threads)
        env = {k: os.environ[k] for k in TEST_HOOKS if k in os.environ}
        self.args = (*model, placement, threads, env, worker_hooks(hooks), work.step)
        self.opts = work.opts
        self.remote = ray.remote(LineWorker).options(
            num_cpus=engine.cpus_per_worker, num_gpus=engine.gpus_per_worker
        )
        super().__init__(width, hooks, work)

    def _new(self):
        return self.remote.remote(*self.args)

    def _ready(self, workers: list) -> list[tuple]:
        return self.ray.get([w.ready.remote() for w in workers])

    def _submit(self, worker, staging: Path, entry: dict):
        return worker.run.remote(str(staging), entry, self.opts)

    def _wait(self):
        [ref], _ = self.ray.wait(list(self.flight), num_returns=1)
        return ref

    def _result(self, key):
        try:
            return self.ray.get(key)
        except self.ray.exceptions.RayActorError as exc:  # the worker's process is gone
            return Lost(_cause(exc))

    def _end(self) -> None:
        """``ray.kill`` only asks; a line's task fails once its worker's process is gone."""
        for worker in self.workers:
            self.ray.kill(worker, no_restart=True)

    def _gone(self, keys: list, timeout: float) -> None:
        self.ray.wait(keys, num_returns=len(keys), timeout=timeout)


def _cause(exc: BaseException) -> str:
    """The first line of a Ray actor error (the rest is Ray's advice and a traceback)."""
    text = " ".join(str(exc).split("\n")[0].split())
    return text[:200] or type(exc).__name__
