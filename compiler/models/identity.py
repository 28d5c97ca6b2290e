"""A base model's identity, for an artefact loaded on it without ctxc (a PEFT adapter's card and
``adapter_config.json``).

The name a user gave ctxc (``gemma-3-270m``, ``gemma-3-1b``, a folder, a ``.gguf`` file) is
ctxc's: plain Transformers and PEFT do not know its aliases, and the bundled model is a GGUF file
in ctxc's cache. :func:`base_identity` says what the name is (a GGUF file with its SHA-256, a
folder with the name and revision it records, a Hugging Face repository with the snapshot's
commit) and what plain ``from_pretrained`` takes offline to load the same weights: a folder or a
repository id in the local cache, and for a GGUF file its folder with ``gguf_file=``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from ctxc.models.load import ALIASES, DEFAULT_MODEL

__all__ = ["BaseIdentity", "base_identity", "file_sha256"]

# A Hugging Face cache snapshot: .../models--ORG--NAME/snapshots/COMMIT
_SNAPSHOT = re.compile(r"models--(?P<repo>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})")
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class BaseIdentity:
    """What a base model is and how plain Transformers loads it offline.

    Attributes:
        name: the name given to ctxc (``ctxc.load_model(name)`` loads it): an alias, a
            repository id, a folder or a ``.gguf`` file (absolute).
        kind: ``gguf`` (a GGUF file, the bundled model's included), ``folder``, ``hub`` (a
            repository of the local Hugging Face cache, an alias's included) or ``unnamed`` (a
            model built in memory, which nothing names).
        resolves_to: what an alias names (its repository id, or the bundled model's GGUF file);
            None for a folder or a file given as such.
        load_path: what ``from_pretrained`` takes: the folder, the GGUF file's folder (with
            :attr:`gguf_file`), or the repository id.
        gguf_file: the GGUF file's name, to pass as ``gguf_file=``; None otherwise.
        sha256: the GGUF file's SHA-256 (hex); None otherwise, or when the file is gone.
        recorded_name: the name the weights record of themselves: a config's ``_name_or_path``
            (or a converted GGUF's ``_model_name_or_path``, its ``general.name``); None if none.
        revision: the commit of a Hugging Face cache snapshot or of a git checkout, when known.
    """

    name: str
    kind: str
    resolves_to: str | None
    load_path: str
    gguf_file: str | None = None
    sha256: str | None = None
    recorded_name: str | None = None
    revision: str | None = None

    def to_dict(self) -> dict:
        """The JSON form (report.json)."""
        return asdict(self)

    def load_kwargs(self) -> str:
        """The keyword arguments ``from_pretrained`` needs besides the path, as Python source
        (``, gguf_file="x.gguf"``, or empty)."""
        return f", gguf_file={json.dumps(self.gguf_file)}" if self.gguf_file else ""

    def describe(self) -> str:
        """One line in words: ``gemma-3-270m (ctxc's bundled Gemma 3 270M: the GGUF file
        gemma-3-270m-q4_k_m.gguf, SHA-256 a5fd...)``."""
        parts = []
        if self.kind == "gguf":
            parts.append(f"the GGUF file `{self.gguf_file}` in `{self.load_path}`")
            parts.append(f"SHA-256 `{self.sha256}`" if self.sha256 else "SHA-256 unknown")
        elif self.kind == "hub":
            parts.append(f"the Hugging Face repository `{self.load_path}`")
        elif self.kind == "unnamed":
            return "a model built in memory, which nothing names"
        else:
            parts.append("a model folder")
        if self.recorded_name:
            parts.append(f"recorded name `{self.recorded_name}`")
        if self.revision:
            parts.append(f"revision `{self.revision}`")
        elif self.kind != "gguf":
            parts.append("revision unknown")
        lead = ""
        if self.name == DEFAULT_MODEL:
            lead = "ctxc's bundled Gemma 3 270M: "
        elif self.resolves_to is not None:
            lead = "ctxc's alias for "
        return f"`{self.name}` ({lead}{', '.join(parts)})"


def base_identity(name: str, loaded_from: str = "") -> BaseIdentity:
    """The identity of the base model ctxc loaded as ``name`` from the folder ``loaded_from``.

    Args:
        name: the name given to ctxc (a model's ``ctxc_name``, a patch's ``meta.model``); empty
            for a model ctxc did not load.
        loaded_from: the folder Transformers loaded (a model's ``name_or_path``: a converted
            GGUF's cache folder, a Hugging Face snapshot, the folder itself).

    Returns:
        the :class:`BaseIdentity`. Side effects: reads (streams) a GGUF file once per process
        for its SHA-256, and a folder's ``config.json``.
    """
    name = name or loaded_from
    if not name:  # a model built in memory: nothing names it
        return BaseIdentity("", "unnamed", None, "")
    folder = Path(loaded_from) if loaded_from else None
    recorded = _recorded_name(folder) if folder is not None else None
    if name == DEFAULT_MODEL or name.endswith(".gguf"):
        gguf = _bundled_gguf() if name == DEFAULT_MODEL else Path(name)
        if gguf is None:  # the bundled package is gone: nothing to hash
            return BaseIdentity(name, "gguf", None, name, recorded_name=recorded)
        return BaseIdentity(
            name,
            "gguf",
            str(gguf) if name == DEFAULT_MODEL else None,
            str(gguf.parent),
            gguf.name,
            file_sha256(gguf) if gguf.is_file() else None,
            recorded,
        )
    snapshot = _SNAPSHOT.search(str(folder)) if folder is not None else None
    if name in ALIASES or (not Path(name).exists() and name.count("/") == 1):
        repo = ALIASES.get(name, name)
        commit = snapshot.group("commit") if snapshot is not None else None
        return BaseIdentity(
            name, "hub", repo if name in ALIASES else None, repo, None, None, recorded, commit
        )
    path = Path(name)
    revision = snapshot.group("commit") if snapshot is not None else _git_commit(path)
    return BaseIdentity(name, "folder", None, name, None, None, _recorded_name(path), revision)


def file_sha256(path: Path) -> str:
    """The SHA-256 of the file at ``path`` (hex), read in 1 MiB blocks; cached in the process by
    the file's real path, size and modification time (a 250 MB GGUF takes about a second)."""
    real = Path(path).resolve()
    stat = real.stat()
    return _sha256(str(real), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256(path: str, _size: int, _mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _bundled_gguf() -> Path | None:
    from ctxc.core.errors import CtxcError
    from ctxc.models.load import bundled_gguf

    try:
        return bundled_gguf()
    except (CtxcError, OSError):
        return None


def _recorded_name(folder: Path) -> str | None:
    """``config.json``'s ``_name_or_path`` (``_model_name_or_path`` in a converted GGUF's)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    found = config.get("_name_or_path") or config.get("_model_name_or_path")
    return str(found) if found else None


def _git_commit(folder: Path) -> str | None:
    """The commit a git checkout of a model folder is at (``.git/HEAD``, its ref, packed refs)."""
    git = folder / ".git"
    try:
        head = (git / "HEAD").read_text(encoding="utf-8").strip()
        if _COMMIT.fullmatch(head):
            return head
        ref = head.removeprefix("ref: ").strip()
        if (git / ref).is_file():
            found = (git / ref).read_text(encoding="utf-8").strip()
            return found if _COMMIT.fullmatch(found) else None
        for line in (git / "packed-refs").read_text(encoding="utf-8").splitlines():
            commit, _, name = line.partition(" ")
            if name.strip() == ref and _COMMIT.fullmatch(commit):
                return commit
    except OSError:
        return None
    return None
