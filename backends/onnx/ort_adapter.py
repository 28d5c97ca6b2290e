"""ONNX Runtime adapter: a patch as an ``.onnx_adapter`` for the patchable ONNX model.

onnxruntime (1.20+) reads adapter files (``onnxruntime.AdapterFormat``) that hold named tensors;
a session fed ``RunOptions.add_active_adapter(onnxruntime.LoraAdapter)`` takes them as the values
of the graph inputs of those names. The patchable ONNX (:mod:`ctxc.backends.onnx.patchable`) has
the patch's factors as graph inputs, so one session serves any number of compiled contexts, one
adapter each, switched per run.

An adapter file has no free-form metadata: its only fields are two integers. ctxc stores the
identity of the ONNX model it was written for (:func:`onnx_identity`: the model fingerprint and
the graph's inputs with their shapes, hashed) as the ``model_version``, and the whole record
(identity, fingerprint, update rule, token ids) beside it in ``<adapter>.json``.
:func:`load_adapter` checks both against the session before it hands the adapter over, so an
adapter for another model or another ONNX graph is refused in one line. Two patchable files of
the same model with the same inputs compute the same function of those inputs and share an
identity: an adapter fits both.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ctxc._version import __version__
from ctxc.backends.onnx.check import (
    ONNX_ATOL,
    LengthCheck,
    check_bound,
    check_lengths,
    ort_session,
    runtime_floor,
)
from ctxc.backends.onnx.export import export_settings, patched_logits, require_onnx
from ctxc.backends.onnx.files import file_size
from ctxc.backends.onnx.patchable import emit_onnx_patchable, inputs_of, patch_feeds
from ctxc.backends.reference import check_ids, reference_logits, torch_logits
from ctxc.core.errors import CtxcError
from ctxc.core.metrics import Fidelity, fidelity, top1_word
from ctxc.patch import Patch

__all__ = [
    "ADAPTER_FILE",
    "PATCHABLE_FILE",
    "AdapterFigures",
    "emit_ort_adapter",
    "load_adapter",
    "onnx_identity",
    "run_adapter",
    "write_adapter",
]

ADAPTER_FILE = "context.onnx_adapter"
PATCHABLE_FILE = "patchable.onnx"
_FORMAT = 1  # the adapter_version field: the layout of ctxc's record


def _record_path(adapter: Path) -> Path:
    return adapter.with_name(adapter.name + ".json")


def onnx_identity(model) -> str:
    """What an adapter must fit: sha256 of the model fingerprint and the graph's inputs.

    Args:
        model: a patchable ``model.onnx`` (path) or an onnxruntime session of one.

    Returns:
        64 hex digits.

    Raises:
        CtxcError: the file has no ctxc fingerprint (not written by ctxc).
    """
    shapes, meta = inputs_of(model)
    fp = meta.get("ctxc.models.fingerprint")
    if fp is None or meta.get("ctxc.patchable") != "1":
        raise CtxcError(
            "the ONNX model is not a patchable ctxc export (no ctxc.models.fingerprint)"
        )
    inputs = {k: [str(d) for d in v] for k, v in shapes.items()}  # a dynamic axis by its name
    key = {"fingerprint": json.loads(fp), "inputs": inputs}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _version_of(identity: str) -> int:
    """The identity as the adapter's ``model_version`` (an int32 field: 28 bits of it)."""
    return int(identity[:7], 16)


def write_adapter(patch: Patch, onnx_model, path: Path) -> dict:
    """Write ``patch`` as an adapter for ``onnx_model``, and its record beside it.

    Args:
        patch: the patch (its fingerprint must be the ONNX model's).
        onnx_model: the patchable ``model.onnx`` (path) or an onnxruntime session of it.
        path: the ``.onnx_adapter`` to write; ``<path>.json`` gets the record.

    Returns:
        the record (also written): ``onnx_identity``, ``fingerprint``, ``parameters``, ...

    Raises:
        CtxcError: the patch does not fit the model (:func:`patch_feeds`).
    """
    import onnxruntime as ort

    feeds = patch_feeds(patch, onnx_model)  # every factor input; zeros where the patch is silent
    identity = onnx_identity(onnx_model)
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(_FORMAT)
    fmt.set_model_version(_version_of(identity))
    fmt.set_parameters({k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in feeds.items()})
    fmt.export_adapter(str(path))
    m = patch.meta
    record = {
        "ctxc_version": __version__,
        "onnx_identity": identity,
        "fingerprint": m.fingerprint,
        "model": m.model,
        "update": m.update,
        "context_ids": m.context_ids,
        "query_ids": m.query_ids,
        "parameters": len(feeds),
    }
    _record_path(path).write_text(json.dumps(record, indent=1) + "\n")
    return record


def load_adapter(path: Path | str, session):
    """An ``onnxruntime.LoraAdapter`` of ``path``, once it is known to fit ``session``.

    Args:
        path: a ``.onnx_adapter`` written by :func:`write_adapter` (its record beside it).
        session: an onnxruntime session of a patchable ctxc ``model.onnx``.

    Returns:
        the loaded adapter, for ``RunOptions.add_active_adapter``.

    Raises:
        CtxcError: a missing or unreadable file, or an adapter for another model or ONNX graph.
    """
    import onnxruntime as ort

    path = Path(path)
    try:
        version = ort.AdapterFormat.read_adapter(str(path)).get_model_version()
        record = json.loads(_record_path(path).read_text())
    except (OSError, RuntimeError, ValueError) as exc:
        raise CtxcError(f"cannot read the adapter {path} or its record: {exc}") from None
    identity = onnx_identity(session)
    if record.get("fingerprint") != json.loads(
        dict(session.get_modelmeta().custom_metadata_map)["ctxc.models.fingerprint"]
    ):
        raise CtxcError(
            f"the adapter {path.name} was computed on another model (fingerprints differ)"
        )
    if record.get("onnx_identity") != identity or version != _version_of(identity):
        raise CtxcError(
            f"the adapter {path.name} was written for another ONNX graph (its inputs differ): "
            "write it for this model.onnx"
        )
    adapter = ort.LoraAdapter()
    adapter.Load(str(path))
    return adapter


def run_adapter(session, adapter, input_ids: np.ndarray) -> np.ndarray:
    """``session``'s logits [1, n, vocab] for ``input_ids`` [1, n] with ``adapter`` active."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_active_adapter(adapter)
    return session.run(["logits"], {"input_ids": input_ids}, options)[0]


@dataclass(frozen=True)
class AdapterFigures:
    """What the adapter backend wrote and how well onnxruntime, with the adapter, reproduces it.

    Attributes:
        file: the adapter's file name; its record is ``<file>.json``.
        onnx_file: the patchable ONNX it fits (a path relative to the output folder when
            written there).
        onnx_identity: the identity both carry.
        parameters: tensors in the adapter (every factor input of the graph).
        size_bytes: the adapter file.
        checks: onnxruntime with the adapter active against the torch patched model, per length.
        tolerance: the absolute bound the checks met
            (:func:`~ctxc.backends.onnx.check.check_bound`: the given bound, ``runtime_floor``
            and, for a baked patch, its effect).
        fidelity: the same fed the query alone, against the full-context model.
        seconds: wall time (the patchable export included when it was written here).
        runtime_floor: onnxruntime's own distance from torch on the unpatched model (the
            session run without an adapter) at the check inputs.
    """

    file: str
    onnx_file: str
    onnx_identity: str
    parameters: int
    size_bytes: int
    checks: tuple[LengthCheck, ...]
    tolerance: float
    fidelity: Fidelity
    seconds: float
    runtime_floor: float | None = None

    def to_dict(self) -> dict:
        """The JSON form written under ``"ort-adapter"`` in ``report.json``."""
        return asdict(self)

    def fidelities(self) -> dict[str, Fidelity]:
        """onnxruntime with the adapter active, held to the patch's figure by the gate."""
        return {"fidelity": self.fidelity}

    def summary(self) -> str:
        """One line for a terminal."""
        worst = max(c.max_abs_diff for c in self.checks)
        f = self.fidelity
        return (
            f"ort-adapter: {self.file} for {self.onnx_file}; onnxruntime with the adapter vs "
            f"torch max {worst:.2g}; vs full context max {f.max_abs_logit_diff:.3g}, top-1 "
            f"{top1_word(f.top1_match)}"
        )


def emit_ort_adapter(
    model: torch.nn.Module,
    patch: Patch,
    out: Path,
    *,
    full: torch.Tensor | None = None,
    onnx: Path | None = None,
    atol: float = ONNX_ATOL,
) -> tuple[Path, AdapterFigures]:
    """Write ``out/context.onnx_adapter`` (and ``out/patchable.onnx`` when ``onnx`` is None).

    The adapter is checked by an onnxruntime session of the patchable model, run with the
    adapter active, against the torch patched model at the query's length and a longer one.

    Args:
        model: the model the patch was computed on (not modified).
        patch: the patch.
        out: the folder to write (created).
        full: the full-context logits at the query positions [k, vocab], if already computed.
        onnx: an existing patchable ``model.onnx`` to write the adapter for; None: export one
            as ``out/patchable.onnx`` from this patch's slots.
        atol: the check's absolute bound on ``max |logits_ort - logits_torch|``.

    Returns:
        the adapter's path and its :class:`AdapterFigures`.

    Raises:
        CtxcError: the patch does not fit ``onnx``, or the check failed.
    """
    require_onnx()
    out.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter()
    ids = check_ids(patch)
    with export_settings(model):
        if full is None:
            full = reference_logits(model, patch)
        if onnx is None:
            onnx, _ = emit_onnx_patchable(
                model, patch, out, full=full, atol=atol, name=PATCHABLE_FILE
            )
        expected = patched_logits(model, patch, ids)
        unpatched = torch_logits(model, ids)
    path = out / ADAPTER_FILE
    session = ort_session(Path(onnx))
    record = write_adapter(patch, session, path)
    adapter = load_adapter(path, session)
    # Without an adapter the session is the unpatched model: onnxruntime's own floor.
    floor = runtime_floor(lambda x: session.run(["logits"], {"input_ids": x})[0], ids, unpatched)
    atol = check_bound(atol, floor, expected, unpatched, patch.meta.baked)
    checks, first = check_lengths(
        lambda x: run_adapter(session, adapter, x), ids, expected, atol, ADAPTER_FILE
    )
    shown = Path(onnx).name if Path(onnx).parent == out else str(onnx)
    figures = AdapterFigures(
        file=path.name,
        onnx_file=shown,
        onnx_identity=record["onnx_identity"],
        parameters=record["parameters"],
        size_bytes=file_size(path),
        checks=checks,
        tolerance=atol,
        fidelity=fidelity(first, full),
        seconds=round(time.perf_counter() - clock, 3),
        runtime_floor=floor,
    )
    return path, figures
