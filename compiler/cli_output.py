"""Output folders of the CLI: what may be replaced, staging beside it, and the final rename.

A folder ctxc writes carries a marker file, ``.ctxc``, that lists the entries ctxc put there.
``--force`` replaces only such a folder (or an empty one); a folder that holds anything else,
the current folder, a folder above it and the ctxc cache are refused whatever the flags, since
replacing them would lose files ctxc did not write. Everything is written into a staging folder
beside the target first, created before any work (so an unwritable target fails in a second,
not after a compile), and renamed into place at the end; an error or an interrupt removes it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ctxc._version import __version__
from ctxc.cache import cache_dir
from ctxc.errors import CtxcError
from ctxc.interrupts import deferred_signals

__all__ = ["MARKER", "check_out", "is_ctxc_output", "output_folder"]

MARKER = ".ctxc"
# What ctxc wrote before the marker existed: such folders are recognised too.
_LEGACY = (
    ({"patch.safetensors", "report.json"}, {"model", "model.onnx", "model.onnx.data", "adapter"}),
    ({"generate.json"}, {"generate.png"}),
)


def is_ctxc_output(folder: Path) -> bool:
    """Whether every entry of ``folder`` is one ctxc wrote there (its marker lists it)."""
    names = {p.name for p in folder.iterdir()}
    try:
        listed = set(json.loads((folder / MARKER).read_text())["entries"])
    except (OSError, ValueError, KeyError, TypeError):
        return any(req <= names <= req | opt for req, opt in _LEGACY)
    return names - {MARKER} <= listed


def check_out(path: Path, force: bool) -> Path:
    """Refuse an output folder whose replacement could lose files ctxc did not write.

    Args:
        path: the ``--out`` value.
        force: ``--force`` (replace an earlier ctxc output).

    Returns:
        the absolute, resolved path.

    Raises:
        CtxcError: the folder is the current one or above it, in the ctxc cache, not a
            folder, holds other files, holds an earlier output without ``force``, or is not
            writable.
    """
    final = path.expanduser().resolve()
    cwd = Path.cwd().resolve()
    cache = cache_dir().expanduser().resolve()
    if final == cwd:
        raise CtxcError(f"--out {path} is the current folder: name a new folder for the output")
    if cwd.is_relative_to(final):
        raise CtxcError(f"--out {path} holds the current folder: name a new folder for the output")
    if final.is_relative_to(cache) or cache.is_relative_to(final):
        raise CtxcError(f"--out {path} overlaps the ctxc cache {cache}: name another folder")
    if final.exists() and not final.is_dir():
        raise CtxcError(f"output path exists and is not a folder: {path}")
    if final.is_dir() and any(final.iterdir()):
        if not is_ctxc_output(final):
            other = sorted(p.name for p in final.iterdir() if p.name != MARKER)[0]
            raise CtxcError(
                f"output folder {path} holds files ctxc did not write ({other!r}): "
                "name another folder (--force replaces only an earlier ctxc output)"
            )
        if not force:
            raise CtxcError(
                f"output folder {path} holds an earlier ctxc output (--force replaces it)"
            )
    if final.is_dir() and not os.access(final, os.W_OK | os.X_OK):
        raise CtxcError(f"output folder {path} is not writable")
    return final


@contextmanager
def output_folder(path: Path, force: bool, command: str) -> Iterator[Path]:
    """Stage the output of ``command`` beside ``path`` and move it there when the body succeeds.

    Args:
        path: the ``--out`` value (checked with :func:`check_out`).
        force: ``--force``.
        command: the ctxc command, recorded in the marker.

    Yields:
        the staging folder to write into (mode per the umask, like every file in it).

    Raises:
        CtxcError: see :func:`check_out`; or the staging folder cannot be created.
    """
    final = check_out(path, force)
    created = _missing_parents(final.parent)
    _clean_dead_staging(final)
    staging = final.parent / f".{final.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:  # one handler: a signal held while creating is delivered inside it, and cleans up
        try:
            with deferred_signals():
                final.parent.mkdir(parents=True, exist_ok=True)
                staging.mkdir()  # os.mkdir's default 0o777 & ~umask, unlike tempfile's 0700
        except OSError as exc:
            raise CtxcError(f"cannot write the output folder {path}: {exc.strerror}") from None
        yield staging
        with deferred_signals():  # the swap must not stop half way
            entries = sorted(p.name for p in staging.iterdir())
            marker = {"written_by": f"ctxc {__version__}", "command": command, "entries": entries}
            (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _follow_umask(staging)
            _swap(staging, final)
    except BaseException:
        with deferred_signals():
            shutil.rmtree(staging, ignore_errors=True)
            _remove_parents(created)
        raise


def _swap(staging: Path, final: Path) -> None:
    """Move ``staging`` to ``final``; an earlier output there is set aside first, deleted after,
    and put back should the move fail, so it is never lost before the new one is in place."""
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.replaced-{os.getpid()}-{secrets.token_hex(4)}"
        final.rename(old)
    try:
        staging.rename(final)
    except BaseException:
        if old is not None:
            old.rename(final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _clean_dead_staging(final: Path) -> None:
    """Remove staging folders for ``final`` left by runs that were killed (their pid is gone)."""
    if not final.parent.is_dir():
        return
    for staging in final.parent.glob(f".{final.name}.partial-*"):
        pid = staging.name.rsplit(".partial-", 1)[1].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(staging, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _follow_umask(folder: Path) -> None:
    """Give every file and folder under ``folder`` the modes the umask asks for.

    Some writers ignore the umask (safetensors' ``save_file``, behind ``save_pretrained``,
    creates 0600 files); the output is the user's, so it gets the user's usual modes.
    """
    umask = os.umask(0)
    os.umask(umask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def _missing_parents(folder: Path) -> list[Path]:
    """The folders ``mkdir(parents=True)`` would create for ``folder``, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_parents(created: list[Path]) -> None:
    # Only the folders this run created, and only while they are empty.
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            return
