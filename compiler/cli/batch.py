"""``ctxc compile --contexts FILE.jsonl``: the batch run (``ctxc.batch``) from the command line.

The run itself is the library's (:func:`ctxc.batch.run_batch`); this module gives it the
command's progress trail, its stderr lines and its flag names (:func:`cli_hooks`) and says how
it went. No torch import at module level.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxc.batch import BatchHooks, CompileJob, run_batch
from ctxc.cli.options import flag_of
from ctxc.cli.progress import is_verbose, progress, quiet_defaults, stage
from ctxc.cli.support import err, load, out, written

if TYPE_CHECKING:
    from ctxc.batch.ray_engine import RayEngine

__all__ = ["PLAIN", "batch_progress", "cli_hooks", "compile_batch"]

PLAIN: dict[str, Any] = {"highlight": False, "markup": False, "soft_wrap": True}


def batch_progress():
    """Contexts done of all and the rate, on the command's progress trail (progress.py)."""
    return progress(rate="contexts/s")


class _LineCount:
    """The contexts counter of a run, opened at its first count (after the model's load, so
    the load's stages are lines of their own) and closed by ``stack``."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack = stack
        self.bar: Any = None
        self.task: Any = None
        self.done = 0

    def __call__(self, done: int, total: int, kept: bool) -> None:
        if self.bar is None:
            self.bar = self.stack.enter_context(batch_progress())
            self.task = self.bar.add_task("contexts", total=total)
        if done > self.done:
            self.bar.update(self.task, advance=done - self.done, kept=kept)
            self.done = done


def _say_error(n: int, problem: str) -> None:
    err.print(f"ctxc: error: line {n}: {problem}", **PLAIN)


def cli_hooks(stack: contextlib.ExitStack) -> BatchHooks:
    """The command's hooks of a batch run: the trail, errors on stderr, flag names.

    Args:
        stack: closes the contexts counter when the run is over.
    """
    verbose = is_verbose()
    return BatchHooks(
        on_stage=stage,
        on_lines=_LineCount(stack),
        on_error=_say_error,
        on_emit=stage,
        name_of=flag_of,
        load=load,
        setup=None if verbose else quiet_defaults,  # a Ray worker never ran ctxc's main
        quiet_ray=not verbose,
    )


def compile_batch(
    contexts: Path,
    out_dir: Path,
    model,
    dtype: str,
    force: bool,
    opts: CompileJob,
    resume=False,
    engine: RayEngine | None = None,
):
    """Compile every line of ``contexts`` into ``out_dir``/<name>/ and say how it went.

    See :func:`ctxc.batch.run_batch`; ``engine``: a Ray cluster's workers (``--engine ray``),
    or None.

    Returns:
        the exit status: 0 when every line succeeded, 1 when some failed.
    """
    with contextlib.ExitStack() as stack:
        hooks = cli_hooks(stack)
        rows = run_batch(contexts, out_dir, (model, dtype), opts, (force, resume), engine, hooks)
    failed = sum(row["status"] == "error" for row in rows)
    done = len(rows) - failed
    if failed:
        err.print(
            f"compiled {done} of {len(rows)} contexts; {failed} failed "
            f"(see {out_dir / 'index.json'})",
            **PLAIN,
        )
        return 1
    kinds = ", ".join(written(opts.kinds))
    out.print(f"compiled {done} of {len(rows)} contexts into {out_dir}/ ({kinds})", **PLAIN)
    return 0
