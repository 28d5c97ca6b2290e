"""What a model writes from its prefix alone, stored: texts that depend on no context.

Every bake's off-topic figures (``compiler/bake/folder.py``) are measured on texts and questions
the model writes fed its prefix alone (the BOS, or a chat template's opening): the same strings
at every bake of that model with that seed, and about 10 s of a default bake of a SQuAD
paragraph on the 2-core machine (two sampling loops over Gemma 3's 262,144-token head; py-spy,
issue 55). A model opted in (:func:`enable`; the command line does it for the models it loads)
gets them from ``$CTXC_CACHE/writing/<key>.json`` when the entry's key matches: the model's
fingerprint (config, names, shapes, sampled weights), what was asked (prefix ids, counts,
lengths, seed), torch's thread count (a sum's order can flip a near-tied draw), the torch,
Transformers and ctxc versions and a digest of the source of the code that writes them. An
entry that fails to parse or whose key differs is written anew, never trusted. Entries are
written to a partial file and renamed into place. ``CTXC_WRITING_CACHE=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

from ctxc._version import __version__
from ctxc.core.cache import cache_dir, partial_entry
from ctxc.models.fingerprint import fingerprint

__all__ = ["FORMAT", "enable", "enabled", "entry_key", "stored_writing"]

FORMAT = 1  # bump when the entry's layout changes
_ATTR = "ctxc_model_writing"

Writing = dict[str, list[str]]


def enable(model: torch.nn.Module, on: bool = True) -> None:
    """Let :func:`stored_writing` keep ``model``'s writing on disk (sets an attribute on it).

    Only for a model whose weights are those it was loaded with (the key samples them).
    """
    setattr(model, _ATTR, on)


def enabled(model: torch.nn.Module) -> bool:
    """Whether ``model`` is opted in and the environment does not turn the store off."""
    return bool(getattr(model, _ATTR, False)) and os.environ.get("CTXC_WRITING_CACHE") != "0"


def entry_key(model: torch.nn.Module, asked: dict, code: Sequence[ModuleType]) -> str:
    """The hex key of ``model``'s writing of ``asked`` (JSON-ready) by the modules ``code``."""
    import transformers

    sources = [hashlib.sha256(Path(m.__file__ or "").read_bytes()).hexdigest() for m in code]
    described = {
        "format": FORMAT,
        "model": fingerprint(model),
        "asked": asked,
        "threads": torch.get_num_threads(),
        "versions": [torch.__version__, transformers.__version__, __version__],
        "code": sources,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def stored_writing(
    model: torch.nn.Module,
    asked: dict,
    code: Sequence[ModuleType],
    write: Callable[[], Writing],
) -> Writing:
    """``write()``'s texts, from the store when ``model`` is opted in and an entry matches.

    Args:
        model: the model that writes (unpatched, as loaded).
        asked: what is written, JSON-ready (the prefix ids, counts, lengths, seeds).
        code: the modules whose functions ``write`` calls (their source is in the key).
        write: writes the texts: name -> list of strings.

    Returns:
        name -> list of strings, as ``write()`` returns them.

    Side effects:
        writes the entry when the model is opted in and none matched (a failure to write it
        is not an error: the texts are returned all the same).
    """
    if not enabled(model):
        return write()
    key = entry_key(model, asked, code)
    path = cache_dir() / "writing" / f"{key}.json"
    got = _read(path, key)
    if got is not None:
        return got
    got = write()
    try:
        with partial_entry(path.parent) as partial:
            partial.write_text(json.dumps({"key": key, "writing": got}), encoding="utf-8")
            os.replace(partial, path)
    except OSError:  # a read-only or full cache: the texts are still this run's
        pass
    return got


def _read(path: Path, key: str) -> Writing | None:
    """The entry's writing when it parses, holds ``key`` and only lists of strings; else None."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    writing = entry.get("writing") if isinstance(entry, dict) else None
    if entry.get("key") != key or not isinstance(writing, dict):
        return None
    for texts in writing.values():
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            return None
    return writing
