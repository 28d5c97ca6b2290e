"""Errors a user can cause, and conditions the maths needs that a block fails.

Every user-facing failure in ctxc is a :class:`CtxcError`: the CLI prints its message on one line
and exits non-zero, without a traceback.
"""

from __future__ import annotations

__all__ = ["CtxcError", "SolveError", "UnpatchableError", "UntraceableError"]


class CtxcError(Exception):
    """A problem the user can fix: bad input, a missing model, an unsupported block."""


class UnpatchableError(CtxcError):
    """The model has blocks that admit no exact patch (see ``Rejection`` reasons)."""


class UntraceableError(CtxcError):
    """No export rung gives a graph that holds for every input (its reason names the branch)."""


class SolveError(CtxcError):
    """A condition the patch maths needs failed at one block (zero norm, zero divisor, ...).

    Args:
        block: module path of the block, e.g. ``model.layers.3.mlp``.
        reason: what failed, with its value.
    """

    def __init__(self, block: str, reason: str) -> None:
        super().__init__(f"block {block}: {reason}")
        self.block = block
        self.reason = reason
