"""The one reader of the text files a user names: a context, a query file, a JSON Lines file.

Every way such a file can be wrong (missing, a folder, unreadable, not UTF-8, blank) is one
:class:`~ctxc.core.errors.CtxcError` naming the file: a usage error (exit 2), never a traceback.
"""

from __future__ import annotations

from pathlib import Path

from ctxc.core.errors import CtxcError

__all__ = ["read_text"]


def read_text(path: Path, what: str) -> str:
    """The UTF-8 text of the file ``path``, which holds more than blanks.

    Args:
        path: the file.
        what: how a message names it (``context file``, ``query file``).

    Returns:
        its text, as written (no line ending changed).

    Raises:
        CtxcError: ``{what} not found: PATH``, ``{what} is not a file: PATH``, ``cannot read
            {what} PATH: <reason>``, ``{what} is not UTF-8 text: PATH (byte N)`` or
            ``{what} is empty: PATH``.
    """
    if not path.exists():
        raise CtxcError(f"{what} not found: {path}")
    if not path.is_file():
        raise CtxcError(f"{what} is not a file: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CtxcError(f"{what} is not UTF-8 text: {path} (byte {exc.start})") from None
    except OSError as exc:
        raise CtxcError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if not text.strip():
        raise CtxcError(f"{what} is empty: {path}")
    return text
