"""Errors a user can cause, and conditions the maths needs that a block fails.

Every user-facing failure in ctxc is a :class:`CtxcError`: the CLI prints its message on one line
and exits non-zero, without a traceback.
"""

from __future__ import annotations

import errno
import re
import string
from collections.abc import Callable

__all__ = [
    "CtxcError",
    "OptionError",
    "SolveError",
    "UnpatchableError",
    "UntraceableError",
    "environment_cause",
    "environment_error",
    "environment_oserror",
    "missing_package",
    "missing_package_error",
]

# Optional libraries a model's code or its processor imports, by import name -> pip package.
_OPTIONAL = {"torchvision": "torchvision", "timm": "timm", "PIL": "Pillow"}
# Transformers' own wording (utils/import_utils.py: TORCHVISION_IMPORT_ERROR, TIMM_IMPORT_ERROR,
# VISION_IMPORT_ERROR): "<Class> requires the <library> library but it was not found".
_REQUIRES = re.compile(r"(\w+) requires the (Torchvision|timm|PIL) library")
_LIBRARY = {"Torchvision": "torchvision", "timm": "timm", "PIL": "Pillow"}


class CtxcError(Exception):
    """A problem the user can fix: bad input, a missing model, an unsupported block.

    A message that names parameters of the library is made with :meth:`naming`: ``str()`` names
    them as the library does (``skip_unpatchable``), :meth:`render` as the caller asks (the CLI:
    ``--skip-unpatchable``, ``compiler/cli/options.py``: ``FLAGS``). Library messages never name
    CLI flags.
    """

    template: str | None = None
    values: tuple[object, ...] = ()
    params: tuple[str, ...] = ()

    def naming(self, template: str, *values: object) -> CtxcError:
        """This error, its message made from ``template``; returns ``self``.

        Args:
            template: a ``str.format`` template: each named field is a library parameter
                (``{max_new_tokens}``), each unnamed one (``{}``, ``{!r}``) takes the next value.
            values: the values of the unnamed fields (never parsed as a template).
        """
        self.template, self.values = template, values
        fields = string.Formatter().parse(template)
        self.params = tuple(name for _, name, _, _ in fields if name and not name.isdigit())
        self.args = (self.render(),)
        return self

    def render(self, name_of: Callable[[str], str] = str) -> str:
        """The message with each parameter it names called ``name_of(parameter)``."""
        if self.template is None:
            return str(self)
        return self.template.format(*self.values, **{p: name_of(p) for p in self.params})


class OptionError(CtxcError):
    """A bad value of a library parameter; the message names the parameter (:meth:`naming`).

    Args:
        template: the message template (:meth:`CtxcError.naming`).
        values: the values of its unnamed fields.

    Example:
        ``OptionError("{rank} must be at least 1 (got {})", 0)``: ``rank must be at least 1
        (got 0)``, printed by ``ctxc bake`` as ``--rank must be at least 1 (got 0)``.
    """

    def __init__(self, template: str, *values: object) -> None:
        super().__init__()
        self.naming(template, *values)


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


def missing_package(exc: BaseException) -> tuple[str, str] | None:
    """The optional library whose absence ``exc`` reports, and who asked for it.

    Args:
        exc: an exception; its ``__cause__`` and ``__context__`` chain is searched too.

    Returns:
        ``(pip package, the class or module that needs it)``, or None when ``exc`` is about
        another import (or no import at all).
    """
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, ImportError):
            root = (link.name or "").split(".")[0]
            if isinstance(link, ModuleNotFoundError) and root in _OPTIONAL:
                return _OPTIONAL[root], root
            found = _REQUIRES.search(str(link))
            if found:
                return _LIBRARY[found.group(2)], found.group(1)
        link = link.__cause__ or link.__context__
    return None


def missing_package_error(exc: BaseException, what: str) -> CtxcError | None:
    """A one-line :class:`CtxcError` naming the package to install, when ``exc`` says one is
    missing (torchvision, timm, Pillow), else None.

    Args:
        exc: the exception raised while loading or running ``what``.
        what: what needed it, for the message (``model 'x': its processor``).
    """
    found = missing_package(exc)
    if found is None:
        return None
    package, asker = found
    return CtxcError(f"{what} needs {package} ({asker} imports it): pip install {package}")


# What the machine refused, not a bug: the disk or its quota full, a read-only or forbidden path.
_ENVIRONMENT = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


def environment_oserror(exc: BaseException) -> OSError | None:
    """The OSError in ``exc``'s cause and context chain (``exc`` included) that is the machine
    refusing a file operation (disk full, quota, read-only, permissions), else None."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError) and link.errno in _ENVIRONMENT:
            return link
        link = link.__cause__ or link.__context__
    return None


def environment_cause(error: OSError) -> str:
    """What the machine refused, in words (``no space left on the device``)."""
    return _ENVIRONMENT.get(error.errno or 0, error.strerror or "the machine refused a write")


def environment_error(exc: BaseException) -> CtxcError | None:
    """A one-line :class:`CtxcError` when ``exc`` (or what caused it) is the machine refusing a
    file operation (disk full, quota, read-only, permissions), else None.

    Args:
        exc: an exception; its ``__cause__`` and ``__context__`` chain is searched too.
    """
    link = environment_oserror(exc)
    if link is None:
        return None
    where = link.filename2 or link.filename
    at = f" writing {where}" if where else ""
    return CtxcError(f"{environment_cause(link)}{at}; nothing of this run was kept")
