"""The output folder of a batch run (``ctxc compile --contexts``, a routed bake's chunks): every
finished line kept as it completes.

DIR is created (or taken over, with ``--resume`` or ``--force``) at the start and held for the
whole run by an ``flock`` on the folder itself, so a second run into it is refused in one line.
Each line is compiled into ``DIR/.NAME.partial-PID-HEX`` and renamed to ``DIR/NAME`` when it is
complete; ``index.json`` and the marker are rewritten whole (a temporary file renamed over
them) after every line, the lines not reached marked ``"not run"``. An interrupt or a crash
therefore leaves finished lines and an index that says which they are.

``--resume`` keeps the lines already written: a line is skipped when its folder's marker has
the same input (SHA-256 of its context and query), every file it lists at its size, and a
patch whose tensors match their stored digest and the marker's; any other folder of that name
is compiled again. The options and the model's fingerprint are stored in DIR's marker; a resume
with others is refused in one line.

A :class:`Layout` says what else a run's DIR is: the command in its marker, the folder its lines
go in (a routed bake's ``DIR/chunks/<id>``), whether it has ``index.json``, and what a line's
row takes from its report.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ctxc.core.errors import CtxcError
from ctxc.core.interrupts import deferred_signals
from ctxc.core.vocabulary import PATCH_FILE, REPORT_FILE
from ctxc.store.output import (
    MARKER,
    check_out,
    clean_dead,
    follow_umask,
    foreign,
    is_busy,
    is_ctxc_output,
    missing_parents,
    placing_lock,
    read_marker,
    remove_parents,
    replace_text,
    write_marker,
)

__all__ = [
    "INDEX",
    "BatchFolder",
    "Layout",
    "batch_folder",
    "check_mode",
    "headline",
    "input_digest",
]

INDEX = "index.json"


def input_digest(entry: dict) -> str:
    """SHA-256 of a line's context and query (and a chat line's turns): what its folder was
    compiled from."""
    parts = [entry["context"], entry["query"]]
    if entry.get("messages") is not None:  # a plain line's digest stays what it was
        parts.append(entry["messages"])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def headline(report: dict) -> dict:
    """A line's figures for index.json, from its report.json."""
    return {
        "max_abs_logit_diff": report["max_abs_logit_diff"],
        "total_variation": report["total_variation"],
        "top1_match": report["top1_match"],
        "control": {"max_abs_logit_diff": report["control"]["max_abs_logit_diff"]},
    }


@dataclasses.dataclass(frozen=True)
class Layout:
    """What a batch run's DIR is besides its lines (the default: a ``--contexts`` run's).

    Attributes:
        command: the command its markers name.
        under: the folder inside DIR its lines go in (``""``: DIR itself).
        index: the index file rewritten after every line, or None.
        summary: a line's row figures from its ``report.json`` (:func:`headline`).
        run: how a message names such a run (a template: ``{contexts}`` is a parameter).
        verb: what a run does to a line, in messages (``compiled``).
    """

    command: str = "compile"
    under: str = ""
    index: str | None = INDEX
    summary: Callable[[dict], dict] = headline
    run: str = "{contexts} run"
    verb: str = "compiled"

    def path(self, name: str) -> str:
        """Line ``name``'s entry in DIR (``chunks/000``; a marker lists it so)."""
        return f"{self.under}/{name}" if self.under else name


class BatchFolder:
    """DIR of a running ``--contexts`` run (see the module docstring).

    Attributes:
        final: the resolved DIR.
        shown: DIR as the user typed it, for messages.
        options: the run's options (stored in the marker; compared on ``--resume``).
        layout: the :class:`Layout`.
        resuming: an earlier run's lines may be kept.
        written: lines this run moved into DIR (finished, or kept after a failed artefact).
    """

    def __init__(
        self,
        final: Path,
        shown: Path,
        options: dict,
        earlier: dict | None,
        layout: Layout | None = None,
    ) -> None:
        self.final = final
        self.shown = shown
        self.options = options
        self.layout = layout or Layout()
        self.resuming = earlier is not None
        self.written = 0
        earlier = earlier or {}
        self._model = earlier.get("model_fingerprint")  # of the run that wrote DIR, if any
        # What ctxc wrote in DIR (a line in a subfolder as ``chunks/000``): only these entries
        # are ever replaced or removed.
        self._entries = {*_firsts(self.layout), *earlier.get("entries", ())}

    def check_model(self, fingerprint: dict) -> None:
        """Refuse to resume lines computed on another model; record this one's fingerprint."""
        if self.resuming and self._model not in (None, fingerprint):
            raise CtxcError().naming(
                "{resume}: output folder {} was " + self.layout.verb + " on another model (its "
                "fingerprint differs): give the same model, or {force} to start afresh",
                self.shown,
            )
        self._model = fingerprint
        self._marker()

    def _marker(self) -> None:
        batch = {"options": self.options, "model_fingerprint": self._model}
        write_marker(self.final, self.layout.command, self._entries, batch=batch)

    def write_index(self, rows: list[dict]) -> None:
        """Rewrite ``index.json`` whole (a temporary file renamed over it); nothing when the
        layout has no index."""
        if self.layout.index is None:
            return
        with deferred_signals():
            replace_text(self.final / self.layout.index, json.dumps(rows, indent=2) + "\n")

    def write_file(self, name: str, text: str) -> None:
        """Write ``DIR/name`` whole (a temporary file renamed over it), listed in the marker
        first (a routed bake's ``router.json``, once every chunk is there)."""
        with deferred_signals():
            self._entries.add(name)
            self._marker()
            replace_text(self.final / name, text)

    def staging(self, name: str) -> Path:
        """A new folder to run line ``name`` into (beside where it goes)."""
        parent = self.final / self.layout.under
        parent.mkdir(exist_ok=True)  # listed from the start (:func:`_firsts`)
        path = parent / f".{name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        path.mkdir()
        return path

    def discard(self, staging: Path) -> None:
        """Remove a line's staging folder (its compile failed or was interrupted)."""
        with deferred_signals():
            shutil.rmtree(staging, ignore_errors=True)

    def commit(self, staging: Path, name: str, digest: str) -> None:
        """Move a finished line's folder into place as ``DIR/name`` (replacing a damaged one).

        Its marker records the input digest, each file's size and the patch's digest.

        Raises:
            CtxcError: ``DIR/name`` is there and not ctxc's (it appeared during the run).
        """
        from ctxc.patch import stored_digest

        files = _sizes(staging)
        patch = stored_digest(staging / PATCH_FILE)
        entry = self.layout.path(name)
        with deferred_signals():
            write_marker(
                staging, self.layout.command, input_sha256=digest, files=files, patch_sha256=patch
            )
            follow_umask(staging)
            self._replace(staging, entry)
            self._remove(f"{entry}.failed")  # an earlier failure of this line, now superseded
            self._marker()
            self.written += 1

    def keep_failed(self, staging: Path, name: str, artefact: str) -> Path:
        """Keep a line whose artefact failed as ``DIR/name.failed``; the path shown."""
        entry = f"{self.layout.path(name)}.failed"
        with deferred_signals():
            write_marker(staging, self.layout.command, failed=artefact)
            follow_umask(staging)
            self._replace(staging, entry)
            self._marker()
            self.written += 1
        return self.shown / entry

    def _replace(self, staging: Path, name: str) -> None:
        target = self.final / name
        if (target.exists() or target.is_symlink()) and name not in self._entries:
            raise CtxcError(f"{self.shown / name} appeared during the run; it was left as it is")
        self._remove(name)
        self._entries.add(name)
        self._marker()  # listed before it is there: DIR stays recognisable at every step
        staging.rename(target)

    def _remove(self, name: str) -> None:
        if name not in self._entries:
            return  # never anything ctxc did not write
        target = self.final / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        self._entries.discard(name)

    def finished(self, name: str, digest: str) -> dict | None:
        """The row figures (``layout.summary``) of line ``name`` as an earlier run wrote it, or
        None when its folder is missing, damaged, or was run on another input."""
        entry = self.layout.path(name)
        folder = self.final / entry
        if not self.resuming or entry not in self._entries or not folder.is_dir():
            return None
        try:
            marker = read_marker(folder)
            if marker.get("input_sha256") != digest:
                return None
            if any((folder / f).stat().st_size != n for f, n in marker["files"].items()):
                return None
            from ctxc.patch import Patch, stored_digest

            Patch.load(folder / PATCH_FILE)  # its tensors against its stored digest
            if stored_digest(folder / PATCH_FILE) != marker["patch_sha256"]:
                return None
            return self.figures(name)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, CtxcError):
            return None

    def figures(self, name: str) -> dict:
        """Line ``name``'s row figures, from its ``report.json`` in DIR (``layout.summary``)."""
        report = json.loads((self.final / self.layout.path(name) / REPORT_FILE).read_text())
        return self.layout.summary(report)

    def remove_if_empty(self, created: list[Path]) -> None:
        """After a run that kept nothing: remove what it wrote, and DIR if it made it."""
        with deferred_signals():
            for name in (MARKER, *_firsts(self.layout)):
                entry = self.final / name
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)  # the lines' folder, empty
                else:
                    entry.unlink(missing_ok=True)
            if created and created[0] == self.final:
                remove_parents(created)


def _firsts(layout: Layout) -> list[str]:
    """What a run writes in DIR before its first line: the index, the lines' folder."""
    return [name for name in (layout.index, layout.under) if name]


def _sizes(folder: Path) -> dict[str, int]:
    return {
        str(p.relative_to(folder)): p.stat().st_size
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def check_mode(force: bool, resume: bool) -> None:
    """Refuse ``force`` with ``resume`` (one line: what each does)."""
    if force and resume:
        raise CtxcError().naming(
            "{resume} and {force} are exclusive: {resume} keeps the lines written, "
            "{force} starts afresh"
        )


@contextmanager
def batch_folder(
    path: Path, force: bool, resume: bool, options: dict, layout: Layout | None = None
) -> Iterator[BatchFolder]:
    """Create (or take over) DIR for a batch run and hold it until the body ends.

    Args:
        path: the ``--out`` value.
        force: ``--force``: an earlier ctxc output there is removed now.
        resume: ``--resume``: an earlier run's lines are kept when the options match (refused
            in one line otherwise); nothing there: every line runs.
        options: the run's options, stored in the marker.
        layout: the :class:`Layout` (None: a ``--contexts`` run's).

    Yields:
        the :class:`BatchFolder`.

    Raises:
        CtxcError: DIR is refused (see :func:`~ctxc.store.output.check_out`), is held by another
            run, holds no such run to resume, or one with other options.
    """
    layout = layout or Layout()
    check_mode(force, resume)
    final = check_out(path, force or resume)
    created = missing_parents(final)
    with deferred_signals():
        try:
            final.parent.mkdir(parents=True, exist_ok=True)  # the lock file goes there
            fd, earlier, old = _take(final, path, resume, options, layout)
        except BaseException as exc:
            remove_parents(created)
            if isinstance(exc, OSError):
                raise CtxcError(f"cannot write the output folder {path}: {exc.strerror}") from None
            raise
    folder = BatchFolder(final, path, options, earlier, layout)
    try:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        clean_dead(final, ".*.partial-*")
        if layout.under:
            clean_dead(final / layout.under, ".*.partial-*")
        yield folder
    except BaseException:
        if folder.written == 0 and not folder.resuming:  # nothing kept: leave nothing
            folder.remove_if_empty(created)
        raise
    finally:
        os.close(fd)  # releases the flock


def _take(final: Path, shown: Path, resume: bool, options: dict, layout: Layout):
    """Under the placing lock: check DIR again, set an earlier output aside (``--force``),
    create DIR, lock it, write the marker.

    Returns:
        (the locked folder's fd; the earlier run's marker when resuming one, else None; the
        set-aside folder to delete, or None).
    """
    old = earlier = None
    with placing_lock(final):
        if final.is_dir() and any(final.iterdir()):
            if not is_ctxc_output(final):
                raise CtxcError(
                    f"output folder {shown} holds files ctxc did not write ({foreign(final)!r})"
                )
            if is_busy(final):
                raise CtxcError(f"output folder {shown} is being written by another ctxc run")
            if resume:
                earlier = _resumable(final, shown, options, layout)
            else:  # --force (check_out refused an earlier output without it)
                old = final.parent / f".{final.name}.replaced-{os.getpid()}-{secrets.token_hex(4)}"
                final.rename(old)
        try:
            final.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CtxcError(f"cannot write the output folder {shown}: {exc.strerror}") from None
        fd = os.open(final, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CtxcError(f"output folder {shown} is being written by another ctxc run") from None
        if earlier is None:
            batch = {"options": options, "model_fingerprint": None}
            write_marker(final, layout.command, _firsts(layout), batch=batch)
    return fd, earlier, old


def _resumable(final: Path, shown: Path, options: dict, layout: Layout) -> dict:
    """What an earlier run of this layout in ``final`` recorded (its entries and model
    fingerprint); a CtxcError when it is no such run or its options differ."""
    try:
        marker = read_marker(final)
        earlier = marker["batch"]["options"]
        entries = [str(e) for e in marker["entries"]]
        if marker["command"] != layout.command:
            raise KeyError("command")
    except (OSError, ValueError, KeyError, TypeError):
        raise CtxcError().naming(
            "{resume}: output folder {} holds no " + layout.run + " to resume ({force} replaces "
            "it)",
            shown,
        ) from None
    differ = sorted(k for k in {*earlier, *options} if earlier.get(k) != options.get(k))
    if differ:
        key = differ[0]
        raise CtxcError().naming(
            "{resume}: output folder {} was " + layout.verb + " with other options ({} {!r}, now "
            "{!r}): give the same options, or {force} to start afresh",
            shown,
            key,
            earlier.get(key),
            options.get(key),
        )
    return {"entries": entries, "model_fingerprint": marker["batch"].get("model_fingerprint")}
