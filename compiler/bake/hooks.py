"""How a bake reports and loads its model: the caller's choice (as ``ctxc.batch.hooks``).

The bake stage prints nothing and knows no flag. A library caller runs it silently (the
default hooks) and gets its figures and artefacts back (:class:`~ctxc.bake.run.BakeRun`); the
command line (``compiler/cli/bake.py``) gives its progress trail, its stderr lines and its model
load with its notices.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

__all__ = ["BakeHooks", "ChunkProgress", "OnBlock", "OnStage"]

OnStage = Callable[[str], None]
OnBlock = Callable[[int, int, str], None]


def _silent(*_) -> None:
    """A hook that does nothing (the library's default: no output)."""


@contextlib.contextmanager
def _no_progress(_label: str, _verb: str) -> Iterator[tuple[OnStage, OnBlock]]:
    """The library's progress: callbacks that do nothing."""
    yield _silent, _silent


def _load(model: str | None, dtype: str):
    """``(net, tokenizer)`` of ``model`` on the CPU, enabled for the export cache and the
    frozen shards of ``model/`` (``ctxc.store.model_load.load_with_stores``)."""
    from ctxc.store.model_load import load_with_stores

    return load_with_stores(model, dtype, None)


@dataclasses.dataclass(frozen=True)
class ChunkProgress:
    """Where a routed bake's chunks stand, told after each one (``BakeHooks.on_chunks``).

    Attributes:
        done: chunks settled of ``total`` (baked, kept from an earlier run, or failed).
        total: the document's chunks.
        kept: chunks of ``done`` an earlier run had baked (``resume``): no work now.
        baked: the chunk just settled was baked now (False: kept).
        elapsed_s: seconds since the chunks began, their models loaded.
        left_s: an estimate of the seconds left: the chunks not done at the rate the chunks
            baked now took, the workers side by side (None before one is baked).
    """

    done: int
    total: int
    kept: int
    baked: bool
    elapsed_s: float
    left_s: float | None


@dataclasses.dataclass(frozen=True)
class BakeHooks:
    """The callbacks of a bake (every one optional).

    Attributes:
        on_stage: ``(text)``: what the bake does now (evaluating, writing an artefact, a
            chunk's start).
        progress: ``(label, verb)`` -> a context manager yielding ``(on_stage, on_block)``
            for one fit: its stages (``full runs``, ``fitting``) and its blocks
            (``(done, total, block)``); the CLI's draws its trail.
        load: ``(model, dtype) -> (net, tokenizer)``: the model load (the CLI's says so on
            stderr, a first-run GGUF conversion included). A routed bake's worker processes
            load with ``ctxc.store.model_load.load_with_stores``.
        on_chunks: a routed bake's :class:`ChunkProgress`, after each chunk.
        setup: called first in each worker process of a routed bake (the CLI: its libraries
            quieted), a module-level function, or None.
        name_of: how a message names a library parameter (the CLI: its flag), a module-level
            function.
    """

    on_stage: OnStage = _silent
    progress: Callable[[str, str], AbstractContextManager[tuple[OnStage, OnBlock]]] = _no_progress
    load: Callable = _load
    on_chunks: Callable[[ChunkProgress], None] = _silent
    setup: Callable[[], None] | None = None
    name_of: Callable[[str], str] = str
