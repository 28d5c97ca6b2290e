"""Output folders ctxc writes: what may be replaced, staging beside it, and the final rename.

A folder ctxc writes carries a marker file, ``.ctxc``, that lists the entries ctxc put there.
``--force`` replaces only such a folder (or an empty one); a folder that holds anything else,
the current folder, a folder above it and the ctxc cache are refused whatever the flags, since
replacing them would lose files ctxc did not write. Everything is written into a staging folder
beside the target first, created before any work (so an unwritable target fails in a second,
not after a compile), and renamed into place at the end; an error or an interrupt removes it.

The target is checked twice: at the start, and again when the output is placed, under a lock
that every ctxc run placing into the same folder takes (``.DIR.lock`` beside it, removed by its
holder). What is there then must be what the start saw: nothing, an empty folder, or (with
``--force``) the very output that was there at the start. Anything else (another run's output,
a user's file) is left as it is; the run fails in one line and keeps its own output in
``DIR.unplaced/``, named in the message. An artefact that fails its check keeps the rest of
the output (the patch, report.json, the artefacts that passed) in ``DIR.failed/``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from ctxc._version import __version__
from ctxc.core.cache import cache_dir
from ctxc.core.checks import ArtefactError
from ctxc.core.errors import CtxcError, environment_cause, environment_oserror
from ctxc.core.interrupts import deferred_signals, pause_point
from ctxc.core.vocabulary import PATCH_FILE, REPORT_FILE

__all__ = [
    "MARKER",
    "check_out",
    "clean_dead",
    "follow_umask",
    "foreign",
    "identity",
    "is_busy",
    "is_ctxc_output",
    "keep_as",
    "missing_parents",
    "output_folder",
    "placing_lock",
    "read_marker",
    "remove_parents",
    "replace_text",
    "write_marker",
]

MARKER = ".ctxc"
# What ctxc wrote before the marker existed: such folders are recognised too.
_LEGACY = (
    ({PATCH_FILE, REPORT_FILE}, {"model", "model.onnx", "model.onnx.data", "adapter"}),
    ({"generate.json"}, {"generate.png"}),
)


def read_marker(folder: Path) -> dict:
    """The marker of ``folder`` (``folder/.ctxc``, as :func:`write_marker` wrote it), parsed.

    Raises:
        OSError: no marker can be read; ValueError: it is not JSON. A caller that reads a key
            also meets KeyError or TypeError on a marker of another shape.
    """
    return json.loads((folder / MARKER).read_text())


def _staging_name(name: str) -> bool:
    """Whether ``name`` is one of ctxc's staging entries (``.X.partial-PID-HEX``)."""
    return name.startswith(".") and ".partial-" in name


def is_ctxc_output(folder: Path) -> bool:
    """Whether every entry of ``folder`` is one ctxc wrote there (its marker lists it).

    Staging entries of a ``--contexts`` run (``.NAME.partial-...``) count as ctxc's.
    """
    names = {p.name for p in folder.iterdir()}
    try:
        listed = set(read_marker(folder)["entries"])
    except (OSError, ValueError, KeyError, TypeError):
        return any(req <= names <= req | opt for req, opt in _LEGACY)
    return {n for n in names if not _staging_name(n)} - {MARKER} <= listed


def foreign(folder: Path) -> str:
    """The first entry of ``folder`` its marker does not list (the first of all without one)."""
    try:
        listed = set(read_marker(folder)["entries"])
    except (OSError, ValueError, KeyError, TypeError):
        listed = set()
    names = sorted(p.name for p in folder.iterdir() if p.name != MARKER)
    return next((n for n in names if n not in listed and not _staging_name(n)), names[0])


def _is_batch(folder: Path) -> bool:
    """Whether ``folder``'s marker is a ``--contexts`` run's."""
    try:
        return "batch" in read_marker(folder)
    except (OSError, ValueError, TypeError):
        return False


def is_busy(folder: Path) -> bool:
    """Whether a ``--contexts`` run holds ``folder`` (an ``flock`` on the folder itself)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases the lock when it was taken
    return False


def identity(final: Path) -> tuple | None:
    """What is at ``final``: None when nothing or an empty folder, else (device, inode,
    marker bytes): any ctxc run that replaces the folder changes it (a new folder is renamed
    there), so a swap can tell the output the start saw from one that appeared since."""
    try:
        if final.is_dir() and not any(final.iterdir()):
            return None
        st = final.stat()
    except FileNotFoundError:
        return None
    try:
        marker = (final / MARKER).read_bytes()
    except OSError:
        marker = b""
    return (st.st_dev, st.st_ino, marker)


def check_out(path: Path, force: bool) -> Path:
    """Refuse an output folder whose replacement could lose files ctxc did not write.

    Args:
        path: the ``--out`` value.
        force: ``--force`` (replace an earlier ctxc output).

    Returns:
        the absolute, resolved path.

    Raises:
        CtxcError: the folder is the current one or above it, in the ctxc cache, not a
            folder, holds other files, holds an earlier output without ``force``, is being
            written by a ``--contexts`` run, or is not writable.
    """
    final = path.expanduser().resolve()
    cwd = Path.cwd().resolve()
    cache = cache_dir().expanduser().resolve()
    if final == cwd:
        raise CtxcError().naming(
            "{out} {} is the current folder: name a new folder for the output", path
        )
    if cwd.is_relative_to(final):
        raise CtxcError().naming(
            "{out} {} holds the current folder: name a new folder for the output", path
        )
    if final.is_relative_to(cache) or cache.is_relative_to(final):
        raise CtxcError().naming(
            "{out} {} overlaps the ctxc cache {}: name another folder", path, cache
        )
    if final.exists() and not final.is_dir():
        raise CtxcError(f"output path exists and is not a folder: {path}")
    if final.is_dir() and any(final.iterdir()):
        if not is_ctxc_output(final):
            raise CtxcError().naming(
                "output folder {} holds files ctxc did not write ({!r}): name another folder "
                "({force} replaces only an earlier ctxc output)",
                path,
                foreign(final),
            )
        if is_busy(final):
            raise CtxcError(f"output folder {path} is being written by another ctxc run")
        if not force:
            more = "; {resume} keeps its finished lines" if _is_batch(final) else ""
            raise CtxcError().naming(
                "output folder {} holds an earlier ctxc output ({force} replaces it" + more + ")",
                path,
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
        CtxcError: see :func:`check_out`; the staging folder cannot be created; the target
            changed while the run wrote (the output is kept in ``DIR.unplaced``); an artefact
            failed (what passed is kept in ``DIR.failed``, when anything is there).
    """
    final = check_out(path, force)
    before = identity(final)
    created = missing_parents(final.parent)
    clean_dead(final.parent, f".{final.name}.partial-*")
    staging = final.parent / f".{final.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:  # one handler: a signal held while creating is delivered inside it, and cleans up
        try:
            with deferred_signals():
                final.parent.mkdir(parents=True, exist_ok=True)
                staging.mkdir()  # os.mkdir's default 0o777 & ~umask, unlike tempfile's 0700
        except OSError as exc:
            raise CtxcError(f"cannot write the output folder {path}: {exc.strerror}") from None
        yield staging
        pause_point("placing")
        with deferred_signals():  # the swap must not stop half way
            write_marker(staging, command)
            follow_umask(staging)
            problem = _place(staging, final, before, force)
            kept = None if problem is None else keep_as(staging, final, "unplaced")
    except ArtefactError as exc:
        with deferred_signals():
            kept = _keep_failed(staging, final, command, exc, created)
        raise CtxcError(_failed_message(exc, path, kept)) from None
    except BaseException as exc:
        # A CtxcError says its own line already (an unwritable DIR, above).
        plain = isinstance(exc, Exception) and not isinstance(exc, CtxcError)
        refused = environment_oserror(exc) if plain else None
        with deferred_signals():
            kept = None if refused is None else _keep_patch(staging, final, command)
            if kept is None:
                shutil.rmtree(staging, ignore_errors=True)
                remove_parents(created)
        if refused is not None:  # the disk full, ...: the user's to fix, said in one line
            raise CtxcError(_refused_message(refused, staging, path, kept)) from None
        raise
    if kept is not None:
        shown = path.expanduser().parent / kept.name
        raise CtxcError(
            f"output folder {path} {problem} while this run wrote its output: "
            f"{path} was left as it is and this run's output is in {shown}/"
        )


def write_marker(folder: Path, command: str, entries=None, **extra) -> None:
    """Write ``folder/.ctxc``: who wrote it, a run id, and the entries ctxc put there.

    Args:
        folder: the output folder.
        command: the ctxc command.
        entries: the names ctxc wrote (default: everything in ``folder``, a staging folder).
        extra: more keys for the marker.
    """
    if entries is None:
        entries = [p.name for p in folder.iterdir() if p.name != MARKER]
    marker = {"written_by": f"ctxc {__version__}", "command": command, "entries": sorted(entries)}
    marker.update(id=secrets.token_hex(8), **extra)
    replace_text(folder / MARKER, json.dumps(marker, indent=2) + "\n")


def replace_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file (per the umask) renamed over it."""
    tmp = path.parent / f".{path.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.write_text(text)
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


def _place(staging: Path, final: Path, before: tuple | None, force: bool) -> str | None:
    """Rename ``staging`` to ``final`` if what is there is what the start saw.

    Returns:
        None when placed; else what changed (``was written by another ctxc run``), with
        ``final`` untouched.
    """
    old = None
    with placing_lock(final):
        problem = _changed(final, before, force)
        if problem is not None:
            return problem
        if identity(final) is not None:  # the earlier output --force replaces: set aside
            old = final.parent / f".{final.name}.replaced-{os.getpid()}-{secrets.token_hex(4)}"
            final.rename(old)
            if not is_ctxc_output(old):  # a file went in just before: never delete it
                other = foreign(old)
                old.rename(final)
                return f"got files ctxc did not write ({other!r})"
        try:
            staging.rename(final)  # also over an empty folder, atomically
        except OSError as exc:
            if old is not None:
                old.rename(final)
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return "got files ctxc did not write"
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return None


def _changed(final: Path, before: tuple | None, force: bool) -> str | None:
    """How ``final`` differs from what a run that may replace ``before`` expects, or None."""
    if not final.exists() and not final.is_symlink():
        return None
    if not final.is_dir():
        return "became a file"
    now = identity(final)
    if now is None:
        return None  # an empty folder: nothing to lose
    if not is_ctxc_output(final):
        return f"got files ctxc did not write ({foreign(final)!r})"
    if is_busy(final):
        return "is being written by another ctxc run"
    if force and before is not None and now == before:
        return None
    return "was written by another ctxc run"


@contextmanager
def placing_lock(final: Path) -> Iterator[None]:
    """Hold the lock every ctxc run takes to place an output at ``final``.

    An ``flock`` on ``.NAME.lock`` beside ``final``, unlinked by its holder before release: a
    waiter that then gets the lock finds its file gone (another inode at the path, or none)
    and tries again, so no lock file outlives the runs (one killed while holding it leaves an
    empty file the next run takes over and removes).
    """
    lock = final.parent / f".{final.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        with suppress(FileNotFoundError):
            os.unlink(lock)
        os.close(fd)


def keep_as(staging: Path, final: Path, suffix: str) -> Path:
    """Rename ``staging`` to the first free ``NAME.SUFFIX``, ``NAME.SUFFIX-2``, ... beside
    ``final`` (never over anything); the path it got."""
    with placing_lock(final):
        n = 1
        while True:
            kept = final.parent / f"{final.name}.{suffix}{'' if n == 1 else f'-{n}'}"
            if not kept.exists() and not kept.is_symlink():
                staging.rename(kept)
                return kept
            n += 1


def _keep_failed(staging: Path, final: Path, command: str, exc: ArtefactError, created):
    """Keep what passed of a run whose artefact failed in ``DIR.failed``; None if nothing."""
    if not staging.is_dir() or not any(staging.iterdir()):
        shutil.rmtree(staging, ignore_errors=True)
        remove_parents(created)
        return None
    write_marker(staging, command, failed=exc.artefact)
    follow_umask(staging)
    return keep_as(staging, final, "failed")


def _keep_patch(staging: Path, final: Path, command: str) -> Path | None:
    """After the machine refused a write (disk full, ...): keep the run's patch, when it was
    written whole (it loads, its digests match), alone in ``DIR.failed`` (a rename: no space
    needed), so ``ctxc export`` can emit the artefacts once there is room; None otherwise.
    Whatever else the run wrote is removed first, freeing its space."""
    from ctxc.patch import Patch

    patch = staging / PATCH_FILE
    try:
        Patch.load(patch)
    except (CtxcError, OSError):
        return None
    try:
        for entry in staging.iterdir():
            if entry != patch:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        try:
            write_marker(staging, command, failed="the disk")
        except OSError:  # the marker is a courtesy; the patch alone is what export reads
            (staging / MARKER).unlink(missing_ok=True)
        return keep_as(staging, final, "failed")
    except OSError:
        return None


def _refused_message(refused: OSError, staging: Path, path: Path, kept: Path | None) -> str:
    """``no space left on the device writing out/model/; ...``: the path as the user named the
    output (not the staging folder), and what was kept."""
    where = str(refused.filename2 or refused.filename or path)
    if where.startswith(str(staging)):
        where = str(path) + where[len(str(staging)) :]
    head = f"{environment_cause(refused)} writing {where}"
    if kept is None:
        return f"{head}; nothing of this run was kept"
    shown = path.expanduser().parent / kept.name
    return (
        f"{head}; the patch is kept in {shown}/ (ctxc export --patch {shown} writes the "
        "artefacts once there is room)"
    )


def _failed_message(exc: ArtefactError, path: Path, kept: Path | None) -> str:
    if kept is None:
        return str(exc)
    shown = path.expanduser().parent / kept.name
    if (kept / PATCH_FILE).is_file():
        return (
            f"{exc}; the patch and what passed are kept in {shown}/ "
            f"(ctxc export --patch {shown} retries without compiling again)"
        )
    return f"{exc}; what passed is kept in {shown}/"


def clean_dead(folder: Path, pattern: str) -> None:
    """Remove the ``pattern`` entries of ``folder`` (``.X.partial-PID-HEX``) whose run is gone."""
    if not folder.is_dir():
        return
    for entry in folder.glob(pattern):
        pid = entry.name.rsplit(".partial-", 1)[1].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def follow_umask(folder: Path) -> None:
    """Give every file and folder under ``folder`` the modes the umask asks for.

    Some writers ignore the umask (safetensors' ``save_file``, behind ``save_pretrained``,
    creates 0600 files); the output is the user's, so it gets the user's usual modes. A file
    with other links (``model/``'s unpatched weights, linked from the cache:
    ``compiler/store/frozen_shards.py``) stays read-only, since a write into it would be a
    write into every folder that links it.
    """
    umask = _umask()
    os.chmod(folder, 0o777 & ~umask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~umask)
        for name in files:
            path = os.path.join(root, name)
            linked = os.stat(path).st_nlink > 1
            os.chmod(path, (0o444 if linked else 0o666) & ~umask)


def missing_parents(folder: Path) -> list[Path]:
    """The folders ``mkdir(parents=True)`` would create for ``folder``, deepest first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing


def remove_parents(created: list[Path]) -> None:
    """Remove the folders a run created (:func:`missing_parents`), only while they are empty."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            return
