"""The batch run: many contexts compiled into folders after one model load, here or on Ray.

``ctxc.compile_many`` is its library entry (:func:`~ctxc.batch.run.compile_many`); the command
line (``ctxc compile --contexts``, ``compiler/cli/batch.py``) calls :func:`run_batch` with its
progress trail and flag names as :class:`BatchHooks`. One context into one folder
(:func:`~ctxc.batch.job.compile_into`) is the step every line, and ``ctxc compile``, goes
through. No torch import at module level.
"""

from __future__ import annotations

from ctxc.batch.hooks import BatchHooks
from ctxc.batch.job import CompileJob, compile_into
from ctxc.batch.run import compile_many, run_batch

__all__ = ["BatchHooks", "CompileJob", "compile_into", "compile_many", "run_batch"]
