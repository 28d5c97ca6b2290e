"""ctxc: compile a context into exact low-rank patches of a transformer's MLP weights.

import ctxc
model, tokenizer = ctxc.load_model("gemma-3-270m")
result = ctxc.compile(model, tokenizer, context="...")
result.patch.apply(model)      # result.patch.remove(model) restores the weights exactly
"""

from __future__ import annotations

__version__ = "0.1.0"

from ctxc.errors import CtxcError, SolveError, UnpatchableError
from ctxc.models import load_model
from ctxc.patch import Delta, Patch, PatchMeta
from ctxc.pipeline import CompileResult, compile
from ctxc.report import CompileReport

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
    "load_model",
]
