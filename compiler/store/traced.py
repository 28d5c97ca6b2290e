"""The frontend cache of a process: each model's export and block map, traced once.

Every stage that runs a model's graph (compile, generate, bake, inspect) asks here; a model
enabled for the export cache loads its graph from disk instead of tracing it
(``export_cache.py``). The graph reads the model's own tensors, so an entry lives as long as
its model.
"""

from __future__ import annotations

import weakref

import torch

from ctxc.frontend.ladder import Frontend
from ctxc.frontend.trace import TracedModel
from ctxc.passes.locate.block_map import BlockMap
from ctxc.passes.locate.locate_blocks import locate_blocks
from ctxc.store.export_cache import frontend_for

__all__ = ["shared_program", "traced_blocks"]

# One frontend per model, reused by every compile of it (the graph reads the model's own tensors):
# its shared export, or its static exports per length (compiler/frontend/ladder.py).
_TRACES: weakref.WeakKeyDictionary[torch.nn.Module, Frontend] = weakref.WeakKeyDictionary()


def traced_blocks(
    model: torch.nn.Module, length: int | None = None
) -> tuple[TracedModel, BlockMap]:
    """The model's export and block map for inputs of ``length`` tokens, cached per model
    (and on disk for a model enabled for the export cache: ``compiler/store/export_cache.py``).

    Args:
        model: the causal LM.
        length: the input length the export must hold for; None: the shared export (dynamic or
            bounded), or a static one at 8 tokens when only the static rung works.

    Returns:
        ``(the traced model, its block map)``.
    """
    frontend = _TRACES.get(model)
    if frontend is None:
        frontend = _TRACES[model] = frontend_for(model, locate_blocks)
    return frontend.traced_for(length)


def shared_program(model: torch.nn.Module) -> tuple[TracedModel, BlockMap] | None:
    """The model's shared export of this process, if one was made (no export, no trace).

    Args:
        model: the causal LM.

    Returns:
        what :func:`traced_blocks` returns for ``length=None`` when the model's frontend has a
        shared export already; None when the model was not traced here or only static exports
        hold for it.
    """
    frontend = _TRACES.get(model)
    return None if frontend is None else frontend.shared
