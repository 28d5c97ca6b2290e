"""The options several ``ctxc`` commands share, declared once, and their choices.

Each choice's values come from ``ctxc.core.vocabulary`` (one place per decision): typer lists
them in ``--help`` and refuses any other value with click's one-line message. No torch import
(``ctxc --help`` stays fast).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from ctxc.core.vocabulary import BACKEND_NAMES, BAKE_METHODS, DTYPES, FORMATS, GGUF_TYPES, RULES

__all__ = ["BakeMethod", "DType", "Format", "GgufType", "Update", "emit_help"]

# A Literal of the vocabulary's names: typer makes it a choice and passes the plain string on.
# A type checker sees str (a Literal cannot be built from a tuple it has not read).
if TYPE_CHECKING:
    Update = DType = GgufType = Format = BakeMethod = str
else:
    Update = Literal[RULES]
    DType = Literal[tuple(DTYPES)]
    GgufType = Literal[tuple(GGUF_TYPES)]
    Format = Literal[tuple(FORMATS)]
    BakeMethod = Literal[tuple(BAKE_METHODS)]


def emit_help(head: str) -> str:
    """``HEAD: torch (model/), onnx (model.onnx), ...``: the backends and what each writes."""
    kinds = ", ".join(f"{name} ({what.split(':')[0]})" for name, what in BACKEND_NAMES.items())
    return f"{head}: {kinds}."
