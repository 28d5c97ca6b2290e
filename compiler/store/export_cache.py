"""The export cache: a model's traced graph and block map on disk, reused across processes.

``torch.export`` of the bundled Gemma takes 15-20 s, and every ``ctxc compile`` is a new process.
A model opted in (:func:`enable`; the CLI does it) gets its shared export (dynamic or bounded
rung) and block map from ``$CTXC_CACHE/exports/<key>.safetensors`` when the entry's key matches:
the model's fingerprint (config, parameter names and shapes, sampled weights), the torch,
Transformers and ctxc versions, a digest of ctxc's own source (the tracer and the locator), the
dtype and the codec's format. Anything else, or an entry that fails to parse or whose digest
does not match its content (truncated, edited, another model's), is rebuilt silently by a fresh
export, never trusted. Entries are written to a partial file and renamed into place, so two
processes that start at once both end with a correct entry (the last rename wins).

The entry is one safetensors file: the tensors the graph reads that are not the model's own
(lifted constants), and in its metadata the graph (:mod:`ctxc.store.graph_codec`), the block
map, the
input signature and a SHA-256 digest of all of it. The model's parameters and buffers are not
stored: the loaded graph reads the live model's tensors, as a fresh export does.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx

from ctxc._version import __version__
from ctxc.core.cache import cache_dir, partial_entry
from ctxc.frontend.ladder import Frontend, build_frontend
from ctxc.frontend.trace import WRAPPED, TracedModel
from ctxc.models.fingerprint import fingerprint
from ctxc.models.offload import is_dispersed
from ctxc.passes.locate.block_map import BlockMap
from ctxc.store.graph_codec import (
    Unstorable,
    decode_blocks,
    decode_graph,
    encode_blocks,
    encode_graph,
)

__all__ = ["FORMAT", "StoredProgram", "enable", "entry_key", "entry_path", "frontend_for"]

FORMAT = 1  # bump when the entry layout or the codec changes
_ATTR = "ctxc_export_cache"  # set on a model that uses the cache (:func:`enable`)
_META = "ctxc.export"


@dataclass(frozen=True)
class StoredProgram:
    """What the pipeline reads of an ``ExportedProgram``, rebuilt from a cache entry.

    Attributes:
        graph_module: the lifted graph (parameters are placeholders).
        state_dict: graph-signature target -> the live model's parameter or buffer.
        constants: target -> tensor (the model's non-persistent buffers, stored constants).
    """

    graph_module: fx.GraphModule
    state_dict: dict[str, torch.Tensor]
    constants: dict[str, torch.Tensor]


def enable(model: torch.nn.Module, on: bool = True) -> None:
    """Let :func:`frontend_for` use the export cache for ``model`` (sets an attribute on it)."""
    setattr(model, _ATTR, on)


def frontend_for(
    model: torch.nn.Module, locate: Callable[[TracedModel], BlockMap]
) -> Frontend[BlockMap]:
    """The model's :class:`Frontend`: from the export cache when enabled and valid, else built.

    A fresh shared export of an enabled model is stored (when the codec can store it exactly);
    a static-only model, or one dispersed over devices and disk, is not cached.
    ``CTXC_EXPORT_CACHE=0`` turns the cache off.

    Args:
        model: the causal LM.
        locate: the block locator, for a fresh export (and for static exports later).

    Returns:
        the frontend; its shared export is a :class:`TracedModel` whose ``program`` is a
        :class:`StoredProgram` when it came from the cache.
    """
    off = os.environ.get("CTXC_EXPORT_CACHE") == "0"
    if off or not getattr(model, _ATTR, False) or is_dispersed(model):
        return build_frontend(model, locate)  # a dispersed model's graph reads its own placer
    key = entry_key(model)
    path = entry_path(key)
    loaded = _load(path, key, model)
    if loaded is not None:
        traced, blocks, reasons = loaded
        return Frontend((traced, blocks), reasons, weakref.ref(model), locate)
    frontend = build_frontend(model, locate)
    if frontend.shared is not None:
        # An uncacheable graph or a read-only cache: compile on, uncached.
        with contextlib.suppress(Unstorable, OSError):
            _store(path, key, model, frontend)
    return frontend


def entry_key(model: torch.nn.Module) -> dict[str, str]:
    """Everything an entry must match to be reused (JSON-ready strings)."""
    import transformers

    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {
        "format": str(FORMAT),
        "fingerprint": json.dumps(fingerprint(model), sort_keys=True),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ctxc": __version__,
        "source": _source_digest(),
        "dtype": ",".join(dtypes),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
    }


def entry_path(key: dict[str, str]) -> Path:
    """The entry file for ``key``."""
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "exports" / f"{name}.safetensors"


_SOURCE: list[str] = []


def _source_digest() -> str:
    """SHA-256 of ctxc's ``.py`` files (the store, the frontend and every pass, subfolders
    included): a changed tracer or locator, even at the same version number, makes new
    entries."""
    if not _SOURCE:
        import ctxc.frontend
        import ctxc.passes

        digest = hashlib.sha256()
        for module in (ctxc.frontend, ctxc.passes):
            folder = Path(str(module.__file__)).parent
            for path in sorted(folder.rglob("*.py")):
                name = path.relative_to(folder).as_posix()
                digest.update(name.encode() + b"\0" + path.read_bytes())
        for path in sorted(Path(__file__).parent.glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        _SOURCE.append(digest.hexdigest())
    return _SOURCE[0]


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers under the export wrapper's names (tied ones too)."""
    prefix = WRAPPED + "."
    named: dict[str, torch.Tensor] = {
        prefix + n: p for n, p in model.named_parameters(remove_duplicate=False)
    }
    named.update({prefix + n: b for n, b in model.named_buffers(remove_duplicate=False)})
    return named


def _payload_digest(text: str, tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(text.encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _store(path: Path, key: dict, model: torch.nn.Module, frontend: Frontend[BlockMap]) -> None:
    """Write the frontend's shared export as an entry at ``path`` (atomically).

    Raises:
        Unstorable: the graph, a tensor or the block map cannot be stored exactly.
    """
    from safetensors.torch import save_file

    assert frontend.shared is not None  # frontend_for stores a shared export only
    traced, blocks = frontend.shared
    own = _model_tensors(model)
    state = dict(traced.program.state_dict)
    consts = {k: v for k, v in traced.program.constants.items()}
    stored: dict[str, torch.Tensor] = {}
    for target, value in {**state, **consts}.items():
        if not isinstance(value, torch.Tensor):
            raise Unstorable(f"constant {target} is not a tensor")
        mine = own.get(target)
        if mine is None or not (mine is value or torch.equal(mine, value)):
            stored[target] = value.detach().clone().contiguous()
    graph = encode_graph(traced.graph_module)
    info = {
        "key": key,
        "graph": graph,
        "blocks": encode_blocks(blocks),
        "state": sorted(state),
        "constants": sorted(consts),
        "param_of": traced.param_of,
        "input_name": traced.input_name,
        "args": [list(a) for a in traced.arg_specs],
        "dtype": str(traced.dtype).removeprefix("torch."),
        "frontend": traced.frontend,
        "seq_range": list(traced.seq_range),
        "reasons": list(frontend.reasons),
    }
    text = json.dumps(info, sort_keys=True)
    _check_round_trip(traced, _rebuild(json.loads(text), stored, model), model)
    with partial_entry(path.parent) as tmp:
        save_file(stored, str(tmp), metadata={_META: text, "digest": _payload_digest(text, stored)})
        os.replace(tmp, path)


def _check_round_trip(traced: TracedModel, again: TracedModel, model: torch.nn.Module) -> None:
    """The stored graph must compute bit for bit what the export computes (a short probe)."""
    lo, hi = traced.seq_range
    n = min(max(4, lo), hi)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 2
    ids = torch.arange(n, dtype=torch.long).remainder(vocab).unsqueeze(0)
    with torch.no_grad():
        want = traced.graph_module(*traced.placeholder_values(ids))
        got = again.graph_module(*again.placeholder_values(ids))
    want, got = _flat(want), _flat(got)
    if len(want) != len(got) or not all(torch.equal(a, b) for a, b in zip(want, got, strict=True)):
        raise Unstorable("the stored graph does not compute what the export computes")


def _flat(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple | list) else [out]


def _load(
    path: Path, key: dict, model: torch.nn.Module
) -> tuple[TracedModel, BlockMap, tuple[str, ...]] | None:
    """``(traced, blocks, reasons)`` from the entry at ``path``, or None when it is missing,
    unreadable, for another key, or its digest does not match its content."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
        text = meta[_META]
        if meta.get("digest") != _payload_digest(text, tensors):
            return None
        info = json.loads(text)
        if info.get("key") != key:
            return None
        traced = _rebuild(info, tensors, model)
        return traced, decode_blocks(info["blocks"]), tuple(info["reasons"])
    except (SafetensorError, OSError, KeyError, ValueError, TypeError, AttributeError):
        return None


def _rebuild(info: dict, stored: dict[str, torch.Tensor], model: torch.nn.Module) -> TracedModel:
    """The :class:`TracedModel` an entry describes, reading the live model's tensors."""
    own = _model_tensors(model)

    def tensor(target: str) -> torch.Tensor:
        value = stored.get(target, own.get(target))
        if value is None:
            raise KeyError(f"{target} is neither stored nor the model's")
        return value

    program = StoredProgram(
        graph_module=decode_graph(info["graph"]),
        state_dict={t: tensor(t) for t in info["state"]},
        constants={t: tensor(t) for t in info["constants"]},
    )
    dtype = getattr(torch, info["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {info['dtype']}")
    return TracedModel(
        program,
        dict(info["param_of"]),
        info["input_name"],
        dtype,
        tuple(tuple(a) for a in info["args"]),
        info["frontend"],
        (int(info["seq_range"][0]), int(info["seq_range"][1])),
    )
