"""ONNX backend: the patched model as ``model.onnx``, the patch baked into its initializers.

The patch is applied with :meth:`Patch.apply` (the weights the solver computed with, bit for bit),
the logits-only wrapper is exported with ``torch.onnx.export(..., dynamo=True)`` and a dynamic
sequence length, the file is written while the patch is still applied (the exporter's initializers
alias the model's parameters), and the patch is removed again. Every export is then run by
onnxruntime at two input lengths against the torch patched model: the exporter silently fixes the
length when it rejects a dynamic spec, so one length proves nothing. A failed check raises.

The export and check machinery (:func:`export_program`, :func:`verify_export`) is shared with the
patchable export in :mod:`ctxc.backends.onnx_patchable`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.export import Dim

from ctxc import __version__
from ctxc.backends.verify import check_ids, reference_logits, torch_logits
from ctxc.errors import CtxcError
from ctxc.metrics import Fidelity, fidelity
from ctxc.patch import Patch
from ctxc.trace import _MAX_SEQ, LogitsOnly, _no_cache

__all__ = [
    "DEFAULT_RTOL",
    "ONNX_FILE",
    "LengthCheck",
    "OnnxFigures",
    "check_lengths",
    "check_signature",
    "emit_onnx",
    "experts_implementation",
    "export_program",
    "export_settings",
    "require_onnx",
    "save_program",
    "verify_export",
]

ONNX_FILE = "model.onnx"

# onnxruntime and torch sum in different orders, and a patched model's post-norm gains amplify
# that (MATH.md 8). The bound is relative to the largest logit, so it means the same for a tiny
# random model (logits ~1, differences ~1e-7) and a trained one: Gemma 3 270M patched on
# examples/short.txt differs by 2.1e-4 at logits of 21, a tenth of the bound.
DEFAULT_RTOL = 1e-4

# The exporter's own tracing would stop at these; a dense rewrite exports (ARCHITECTURES.md).
_EXPORTABLE_EXPERTS = "batched_mm"


def require_onnx() -> None:
    """Raise a one-line CtxcError when the ONNX extras are not installed."""
    missing = [m for m in ("onnx", "onnxruntime", "onnxscript") if not importlib.util.find_spec(m)]
    if missing:
        raise CtxcError(
            f"ONNX export needs {', '.join(missing)}: pip install 'ctxc[onnx]' "
            "(onnx, onnxruntime, onnxscript)"
        )


@dataclass(frozen=True)
class LengthCheck:
    """onnxruntime against the torch patched model, at one input length.

    Attributes:
        length: the number of input tokens.
        max_abs_diff: ``max |logits_ort - logits_torch|`` over positions and vocabulary.
        mean_abs_diff: the mean of the same.
        top1_match: the argmax agrees at every position.
    """

    length: int
    max_abs_diff: float
    mean_abs_diff: float
    top1_match: bool


@dataclass(frozen=True)
class OnnxFigures:
    """What an ONNX export wrote and how well onnxruntime reproduces the torch patched model.

    Attributes:
        file: the file name (``model.onnx``), relative to the output folder.
        patchable: the patch factors are graph inputs (else baked into the initializers).
        opset: the default-domain ONNX opset of the graph.
        external_data: the weights went to ``model.onnx.data`` (the file would pass 2 GB).
        size_bytes: ``model.onnx`` plus its external data.
        experts: the MoE expert implementation exported, or ``"dense"``.
        patch_inputs: graph inputs besides ``input_ids`` (the patch factors; 0 when baked).
        checks: one :class:`LengthCheck` per input length (the query's first).
        tolerance: the bound every check's ``max_abs_diff`` met.
        fidelity: onnxruntime fed the query alone against the full-context model.
        export_seconds, check_seconds: wall times.
    """

    file: str
    patchable: bool
    opset: int
    external_data: bool
    size_bytes: int
    experts: str
    patch_inputs: int
    checks: tuple[LengthCheck, ...]
    tolerance: float
    fidelity: Fidelity
    export_seconds: float
    check_seconds: float

    def to_dict(self) -> dict:
        """The JSON form written under ``"onnx"`` in ``report.json``."""
        return asdict(self)

    def summary(self) -> str:
        """One line for a terminal."""
        checks = ", ".join(f"{c.max_abs_diff:.2g} at {c.length}" for c in self.checks)
        f = self.fidelity
        kind = "patchable " if self.patchable else ""
        return (
            f"onnx: {kind}{self.file} (opset {self.opset}, {self.experts}); onnxruntime vs torch "
            f"max {checks} tokens; vs full context max {f.max_abs_logit_diff:.3g}, "
            f"top-1 {'match' if f.top1_match else 'MISMATCH'}"
        )


def experts_implementation(model: torch.nn.Module) -> str:
    """``"dense"`` for a model without MoE expert modules, else its experts implementation.

    Transformers dispatches expert modules through ``config._experts_implementation``
    (``grouped_mm``, ``batched_mm``, ``eager``); models without them cannot set it.
    """
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if not (callable(can_set) and can_set()):
        return "dense"
    return str(getattr(model.config, "_experts_implementation", None) or "eager")


@contextlib.contextmanager
def export_settings(model: torch.nn.Module) -> Iterator[str]:
    """No KV cache and an exportable expert implementation, restored afterwards; eval mode.

    ``grouped_mm`` leaves a custom op in the graph and the ``eager`` expert loop does not trace;
    ``batched_mm`` (index + bmm) exports (ARCHITECTURES.md, export facts). The model is left in
    eval mode, as :func:`ctxc.trace.trace` leaves it.

    Yields:
        the expert implementation in force (``"dense"`` for a dense model), for the report.
    """
    model.eval()
    before = experts_implementation(model)
    used = before
    if before not in ("dense", _EXPORTABLE_EXPERTS):
        model.set_experts_implementation(_EXPORTABLE_EXPERTS)
        used = f"{_EXPORTABLE_EXPERTS} (the model's {before} does not export to ONNX)"
    try:
        with _no_cache(model):
            yield used
    finally:
        if used != before:
            model.set_experts_implementation(before)


def seq_dim(model: torch.nn.Module) -> Dim:
    """The dynamic sequence dimension, bounded as :func:`ctxc.trace.trace` bounds it."""
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None) or _MAX_SEQ
    return Dim("seq", min=1, max=max(2, min(int(max_pos), _MAX_SEQ)))


def check_lengths(
    run: Callable[[np.ndarray], np.ndarray],
    ids: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    rtol: float = DEFAULT_RTOL,
) -> tuple[tuple[LengthCheck, ...], float, torch.Tensor]:
    """Run an exported model at each input length and compare with the torch patched model.

    Args:
        run: int64 ids [1, n] -> logits [1, n, vocab] (an onnxruntime session's run).
        ids: the inputs, each [1, n] int64, lengths distinct.
        expected: the torch patched model's logits [n, vocab] for each input.
        rtol: the bound on ``max |diff|``, relative to ``max(1, max |expected|)``.

    Returns:
        the checks, the tolerance applied, and the logits at the first input [n, vocab].

    Raises:
        CtxcError: a run fails (a length the export fixed), gives the wrong shape, non-finite
            values, or a difference above the tolerance.
    """
    scale = max([1.0] + [float(e.abs().max()) for e in expected])
    tol = rtol * scale
    checks = []
    first: torch.Tensor | None = None
    for x, want in zip(ids, expected, strict=True):
        n = int(x.shape[1])
        try:
            got = run(x.numpy().astype(np.int64))
        except Exception as exc:  # onnxruntime raises its own types; all mean the same here
            raise CtxcError(
                f"onnxruntime could not run the export at {n} tokens: {_root_cause(exc)}"
            ) from None
        if tuple(got.shape) != (1, *want.shape):
            raise CtxcError(
                f"the export gives logits of shape {tuple(got.shape)} at {n} tokens, "
                f"expected {(1, *want.shape)}"
            )
        logits = torch.from_numpy(np.asarray(got[0], dtype=np.float32))  # [n, vocab]
        diff = (logits.double() - want.double()).abs()
        check = LengthCheck(
            length=n,
            max_abs_diff=float(diff.max()),
            mean_abs_diff=float(diff.mean()),
            top1_match=bool((logits.argmax(-1) == want.argmax(-1)).all()),
        )
        # NaN compares false: "not <=" also catches non-finite logits.
        if not check.max_abs_diff <= tol:
            raise CtxcError(
                f"onnxruntime disagrees with the torch patched model at {n} tokens: "
                f"max |diff| {check.max_abs_diff:.3g} (mean {check.mean_abs_diff:.3g}) "
                f"exceeds {tol:.3g}"
            )
        checks.append(check)
        if first is None:
            first = logits
    assert first is not None
    return tuple(checks), tol, first


def _root_cause(exc: BaseException) -> str:
    """The first line of the innermost cause, without terminal colour codes."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def ort_session(path: Path):
    """An onnxruntime CPU session of ``path``."""
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def export_program(
    module: torch.nn.Module,
    args: tuple,
    dynamic_shapes: tuple,
    input_names: Sequence[str],
    opset: int | None,
):
    """``torch.onnx.export(..., dynamo=True)``; any failure becomes a one-line CtxcError.

    Returns:
        the ``torch.onnx.ONNXProgram``; its initializers alias ``module``'s tensors, so save it
        before changing them.
    """
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # Dims shared by several inputs (a patch factor pair's rank) draw one warning each.
            warnings.filterwarnings("ignore", message=r"# The axis name")
            return torch.onnx.export(
                module,
                args,
                dynamo=True,
                dynamic_shapes=dynamic_shapes,
                input_names=list(input_names),
                output_names=["logits"],
                opset_version=opset,
                verbose=False,
            )
    except Exception as exc:  # the exporter raises many types; all mean the same to a user
        raise CtxcError(f"ONNX export failed: {_root_cause(exc)}") from exc


def save_program(program, path: Path, metadata: dict[str, str], external_data: bool | None) -> bool:
    """Write ``program`` to ``path`` with ``metadata``; returns whether the weights went external.

    ``external_data=None`` leaves the choice to the exporter, which moves the weights to
    ``<path>.data`` when the file would pass protobuf's 2 GB.
    """
    program.model.metadata_props.update(metadata)
    data = path.with_name(path.name + ".data")
    program.save(str(path), external_data=external_data)
    return data.exists()


def patch_metadata(model: torch.nn.Module, patch: Patch, patchable: bool) -> dict[str, str]:
    """ONNX metadata_props naming what the file holds."""
    m = patch.meta
    return {
        "ctxc.version": __version__,
        "ctxc.patchable": "1" if patchable else "0",
        "ctxc.model": m.model or str(getattr(model, "name_or_path", "")),
        "ctxc.fingerprint": json.dumps(m.fingerprint),
        "ctxc.update": m.update,
        "ctxc.context_ids": json.dumps(m.context_ids),
        "ctxc.query_ids": json.dumps(m.query_ids),
    }


def file_size(path: Path) -> int:
    """``path`` plus its external data file, in bytes."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def emit_onnx(
    model: torch.nn.Module,
    patch: Patch,
    out: Path,
    *,
    full: torch.Tensor | None = None,
    opset: int | None = None,
    external_data: bool | None = None,
    rtol: float = DEFAULT_RTOL,
) -> tuple[Path, OnnxFigures]:
    """Write ``out/model.onnx``: the patched model, ``input_ids`` int64 [1, seq] -> ``logits``.

    The patch is baked into the initializers; ``model`` is left as it was. The file is checked by
    onnxruntime at the query's length and at a longer one against the torch patched model.

    Args:
        model: the model the patch was computed on (not checked: the caller has done so).
        patch: the patch to bake.
        out: the folder to write (created).
        full: the full-context logits at the query positions [k, vocab], if already computed
            (default: computed here with :func:`reference_logits`).
        opset: the ONNX opset (default: the exporter's).
        external_data: force (True) or forbid (False) ``model.onnx.data``; default: only when
            the file would pass 2 GB.
        rtol: the check's bound, relative to the largest logit (see :func:`check_lengths`).

    Returns:
        the path of ``model.onnx`` and its :class:`OnnxFigures`.

    Raises:
        CtxcError: the export or its check failed (the file may have been written).
    """
    require_onnx()
    out.mkdir(parents=True, exist_ok=True)
    path = out / ONNX_FILE
    ids = check_ids(patch)
    clock = time.perf_counter()
    with export_settings(model) as experts:
        if full is None:
            full = reference_logits(model, patch)
        patch.apply(model, check=False)
        try:
            expected = torch_logits(model, ids)
            program = export_program(
                LogitsOnly(model).eval(),
                (ids[-1],),
                ({1: seq_dim(model)},),
                ["input_ids"],
                opset,
            )
            # Saved while the patch is applied: the program's initializers are the parameters.
            external = save_program(
                program, path, patch_metadata(model, patch, False), external_data
            )
            opset_used = int(program.model.opset_imports.get("", 0))
            del program
        finally:
            patch.remove(model)
    figures = verify_export(
        path,
        ids,
        expected,
        full,
        patchable=False,
        feeds=lambda _session: {},
        opset=opset_used,
        external_data=external,
        experts=experts,
        export_seconds=time.perf_counter() - clock,
        rtol=rtol,
    )
    return path, figures


def verify_export(
    path: Path,
    ids: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    full: torch.Tensor,
    *,
    patchable: bool,
    feeds: Callable[[Any], dict[str, np.ndarray]],
    opset: int,
    external_data: bool,
    experts: str,
    export_seconds: float,
    rtol: float,
) -> OnnxFigures:
    """Open ``path`` with onnxruntime, check its signature and lengths, gather its figures.

    Args:
        path: the written ``model.onnx``.
        ids: the check inputs (:func:`ctxc.backends.verify.check_ids`).
        expected: the torch patched model's logits [n, vocab] for each input.
        full: the full-context logits at the query positions [k, vocab].
        patchable: the file takes the patch as inputs.
        feeds: session -> the inputs besides ``input_ids`` (the patch's factors, when
            patchable).
        opset, external_data, experts, export_seconds: figures of the export itself.
        rtol: the check's bound (see :func:`check_lengths`).

    Returns:
        the :class:`OnnxFigures`.

    Raises:
        CtxcError: the signature is not the contract's or a check fails.
    """
    clock = time.perf_counter()
    session = ort_session(path)
    check_signature(session)
    fed = feeds(session)
    checks, tol, first = check_lengths(
        lambda x: session.run(["logits"], {**fed, "input_ids": x})[0], ids, expected, rtol
    )
    return OnnxFigures(
        file=path.name,
        patchable=patchable,
        opset=opset,
        external_data=external_data,
        size_bytes=file_size(path),
        experts=experts,
        patch_inputs=len(session.get_inputs()) - 1,
        checks=checks,
        tolerance=tol,
        fidelity=fidelity(first, full),
        export_seconds=round(export_seconds, 3),
        check_seconds=round(time.perf_counter() - clock, 3),
    )


def check_signature(session) -> None:
    """The contract: ``input_ids`` int64 [1, dynamic length] first, one output ``logits``.

    Raises:
        CtxcError: another signature, or a fixed length (a rejected dynamic shape).
    """
    ids = session.get_inputs()[0]
    if ids.name != "input_ids":
        raise CtxcError(f"the export's first input is {ids.name!r}, expected 'input_ids'")
    if ids.type != "tensor(int64)" or len(ids.shape) != 2 or isinstance(ids.shape[1], int):
        raise CtxcError(
            f"the export's input_ids is {ids.type} {ids.shape}: the sequence length was fixed "
            "(the exporter rejected the dynamic shape)"
        )
    outputs = [o.name for o in session.get_outputs()]
    if outputs != ["logits"]:
        raise CtxcError(f"the export's outputs are {outputs}, expected ['logits']")
