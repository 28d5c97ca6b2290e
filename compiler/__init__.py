"""ctxc: compile a context into exact low-rank patches of a transformer's MLP weights.

import ctxc
model, tokenizer = ctxc.load_model("gemma-3-270m")
result = ctxc.compile(model, tokenizer, context="...")
result.patch.apply(model)      # result.patch.remove(model) restores the weights exactly

The names below load on first use, so ``import ctxc`` (and ``ctxc --help``) does not import
torch or Transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ctxc._version import __version__
from ctxc.core.errors import CtxcError, SolveError, UnpatchableError

if TYPE_CHECKING:
    from ctxc.batch import compile_many
    from ctxc.core.report import CompileReport
    from ctxc.models.load import load_model
    from ctxc.patch import Delta, Patch, PatchMeta
    from ctxc.pipeline import CompileResult, compile

__all__ = [
    "CompileReport",
    "CompileResult",
    "CtxcError",
    "Delta",
    "Patch",
    "PatchMeta",
    "SolveError",
    "UnpatchableError",
    "__version__",
    "compile",
    "compile_many",
    "load_model",
]

# Public name -> the module that defines it, imported on first attribute access.
_LAZY = {
    "load_model": "ctxc.models.load",
    "Delta": "ctxc.patch",
    "Patch": "ctxc.patch",
    "PatchMeta": "ctxc.patch",
    "CompileResult": "ctxc.pipeline",
    "compile": "ctxc.pipeline",
    "compile_many": "ctxc.batch",
    "CompileReport": "ctxc.core.report",
}


def __getattr__(name: str):
    """Import the module that defines ``name`` on first use (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ctxc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
