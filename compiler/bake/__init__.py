"""The bake: one reusable patch per context, fitted or distilled over many queries, written
with its figures and artefacts (``ctxc bake``, ``ctxc eval-bake``, ``ctxc route``).

What a caller uses, the command line included (an import-linter contract keeps
``compiler/cli/`` to these names):

    from ctxc.bake import BakeJob, bake_into
    run = bake_into(BakeJob(Path("out"), context=text))
    run.report["figures"], run.lines

The run (:mod:`ctxc.bake.run`, :mod:`ctxc.bake.routed`) checks the request before the model
loads, writes the folder staged, and reports through :class:`BakeHooks` (silent by default).
The names load on first use: importing ``ctxc.bake`` imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ctxc.bake.driver import BakeResult, bake
    from ctxc.bake.folder import evaluate_folder, summary_lines
    from ctxc.bake.hooks import BakeHooks, ChunkProgress
    from ctxc.bake.job import BakeJob, BakeRun, HeldOut
    from ctxc.bake.route import CHUNK_WORDS, ROUTER_FILE, Router
    from ctxc.bake.routed import CHUNKS_DIR, bake_routed, change_routed, is_routed
    from ctxc.bake.run import bake_additive, bake_into, change_additive, preflight
    from ctxc.bake.scope import SCOPE_FILE, Scope
    from ctxc.bake.serve import check_servable
    from ctxc.core.options import BakeOptions

__all__ = [
    "CHUNKS_DIR",
    "CHUNK_WORDS",
    "ROUTER_FILE",
    "SCOPE_FILE",
    "BakeHooks",
    "BakeJob",
    "BakeOptions",
    "BakeResult",
    "BakeRun",
    "ChunkProgress",
    "HeldOut",
    "Router",
    "Scope",
    "bake",
    "bake_additive",
    "bake_into",
    "bake_routed",
    "change_additive",
    "change_routed",
    "check_servable",
    "evaluate_folder",
    "is_routed",
    "preflight",
    "summary_lines",
]

_LAZY = {
    "BakeResult": "ctxc.bake.driver",
    "bake": "ctxc.bake.driver",
    "evaluate_folder": "ctxc.bake.folder",
    "summary_lines": "ctxc.bake.folder",
    "BakeHooks": "ctxc.bake.hooks",
    "ChunkProgress": "ctxc.bake.hooks",
    "BakeJob": "ctxc.bake.job",
    "BakeRun": "ctxc.bake.job",
    "HeldOut": "ctxc.bake.job",
    "CHUNK_WORDS": "ctxc.bake.route",
    "ROUTER_FILE": "ctxc.bake.route",
    "Router": "ctxc.bake.route",
    "Scope": "ctxc.bake.scope",
    "SCOPE_FILE": "ctxc.bake.scope",
    "CHUNKS_DIR": "ctxc.bake.routed",
    "bake_routed": "ctxc.bake.routed",
    "change_routed": "ctxc.bake.routed",
    "is_routed": "ctxc.bake.routed",
    "bake_additive": "ctxc.bake.run",
    "bake_into": "ctxc.bake.run",
    "change_additive": "ctxc.bake.run",
    "preflight": "ctxc.bake.run",
    "check_servable": "ctxc.bake.serve",
    "BakeOptions": "ctxc.core.options",
}


def __getattr__(name: str):
    """Import the module that defines ``name`` on first use (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ctxc.bake' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
