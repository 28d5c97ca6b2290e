"""The ctxc cache folder and its partial entries, which a killed run must not leave for good.

A partial entry ``.partial-<pid>-<token>`` comes with a lock file ``.partial-<pid>-<token>.lock``
that its owner holds an exclusive ``flock`` on while it writes. The kernel drops the lock when the
owner dies, however it dies, so the next run can tell a stale entry (lock free) from one a
concurrent run is still writing (lock held) and removes only the stale ones.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ctxc.core.interrupts import deferred_signals

__all__ = ["PARTIAL_PREFIX", "cache_dir", "clean_stale", "partial_entry"]

PARTIAL_PREFIX = ".partial-"
# A partial entry without a lock file comes from a ctxc before the locks; conversions take
# minutes, so one untouched for an hour is stale.
_UNLOCKED_STALE_S = 3600


def cache_dir() -> Path:
    """Where converted models live: ``$CTXC_CACHE`` or ``~/.cache/ctxc``."""
    return Path(os.environ.get("CTXC_CACHE", Path.home() / ".cache" / "ctxc"))


@contextmanager
def partial_entry(parent: Path) -> Iterator[Path]:
    """A new partial entry (a path, not yet created) in ``parent``, owned by this process.

    Move the finished entry into place inside the ``with`` body; whatever is left at the path
    when the body ends (by error or interrupt too) is removed with its lock.

    Args:
        parent: the folder to create it in (created when missing); its stale entries are removed.

    Yields:
        the path to write the entry at (a file or a folder).
    """
    parent.mkdir(parents=True, exist_ok=True)
    clean_stale(parent)
    name = f"{PARTIAL_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    lock = parent / f"{name}.lock"
    path = parent / name
    fd = None
    try:
        with deferred_signals():  # the lock and its owner's pid must exist together
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        with deferred_signals():
            _remove(path)
            lock.unlink(missing_ok=True)
            if fd is not None:
                os.close(fd)


def clean_stale(parent: Path) -> list[str]:
    """Remove the partial entries in ``parent`` whose owner is gone.

    Args:
        parent: a cache folder.

    Returns:
        the names removed.
    """
    try:
        names = {
            p.name.removesuffix(".lock")
            for p in parent.iterdir()
            if p.name.startswith(PARTIAL_PREFIX)
        }
    except OSError:
        return []
    removed = []
    for name in sorted(names):
        path, lock = parent / name, parent / f"{name}.lock"
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            try:
                age = time.time() - path.lstat().st_mtime
            except OSError:
                continue
            if age > _UNLOCKED_STALE_S:
                _remove(path)
                removed.append(name)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live run holds it
            os.close(fd)
            continue
        try:
            _remove(path)
            lock.unlink(missing_ok=True)
            removed.append(name)
        finally:
            os.close(fd)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
