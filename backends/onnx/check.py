"""The check every ONNX export passes: onnxruntime against the torch patched model.

The written file is opened by a plain onnxruntime CPU session, its signature is checked against
the contract (``input_ids`` int64 [1, dynamic length] -> ``logits``), and it is run at two input
lengths: the exporter silently fixes the length when it rejects a dynamic spec, so one length
proves nothing. A difference above :data:`ONNX_ATOL` fails the check
(:func:`ctxc.core.checks.enforce`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ctxc.backends.onnx.export import root_cause
from ctxc.backends.onnx.files import file_size
from ctxc.backends.onnx.thresholds import ONNX_ATOL, ONNX_FLOOR_FACTOR, ONNX_PATCH_SHARE
from ctxc.core.checks import enforce
from ctxc.core.errors import CtxcError
from ctxc.core.metrics import Fidelity, fidelity, top1_word
from ctxc.core.thresholds import floor_bound

__all__ = [
    "ONNX_ATOL",
    "LengthCheck",
    "OnnxFigures",
    "check_bound",
    "check_lengths",
    "check_signature",
    "ort_session",
    "runtime_floor",
    "verify_export",
]


@dataclass(frozen=True)
class LengthCheck:
    """onnxruntime against the torch patched model, at one input length.

    Attributes:
        length: the number of input tokens.
        max_abs_diff: ``max |logits_ort - logits_torch|`` over positions and vocabulary.
        mean_abs_diff: the mean of the same.
        max_rel_diff: ``max_abs_diff / max |logits_torch|`` (the relative figure).
        max_abs_logit: ``max |logits_torch|``, the scale ``max_rel_diff`` is relative to.
        top1_match: the argmax agrees at every position.
    """

    length: int
    max_abs_diff: float
    mean_abs_diff: float
    max_rel_diff: float
    max_abs_logit: float
    top1_match: bool


@dataclass(frozen=True)
class OnnxFigures:
    """What an ONNX export wrote and how well onnxruntime reproduces the torch patched model.

    Attributes:
        file: the file name (``model.onnx``), relative to the output folder.
        patchable: the patch factors are graph inputs (else baked into the graph).
        opset: the default-domain ONNX opset of the graph.
        external_data: the weights went to ``model.onnx.data`` (the file would pass 2 GB).
        size_bytes: ``model.onnx`` plus its external data.
        experts: the MoE expert implementation exported, or ``"dense"``.
        patch_inputs: graph inputs besides ``input_ids`` (the patch factors; 0 when baked).
        checks: one :class:`LengthCheck` per input length (the query's first).
        tolerance: the absolute bound every check's ``max_abs_diff`` met
            (:func:`~ctxc.core.thresholds.floor_bound` of ``ONNX_ATOL`` and ``runtime_floor``).
        fidelity: onnxruntime fed the query alone against the full-context model.
        export_seconds, check_seconds: wall times.
        deltas_inserted: parameters replaced in the graph by ``insert_deltas`` (baked; 0 when
            patchable).
        runtime_floor: onnxruntime's own distance from torch on the unpatched model at the
            check inputs (the patchable graph fed no factors), or None (a baked file has no
            unpatched twin to run).
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
    deltas_inserted: int = 0
    runtime_floor: float | None = None

    def to_dict(self) -> dict:
        """The JSON form written under ``"onnx"`` in ``report.json``."""
        return asdict(self)

    def fidelities(self) -> dict[str, Fidelity]:
        """onnxruntime fed the query alone, held to the patch's figure by the gate."""
        return {"fidelity": self.fidelity}

    def summary(self) -> str:
        """One line for a terminal."""
        checks = ", ".join(
            f"{c.max_abs_diff:.2g} ({c.max_rel_diff:.2g} rel.) at {c.length}" for c in self.checks
        )
        f = self.fidelity
        kind = "patchable " if self.patchable else ""
        return (
            f"onnx: {kind}{self.file} (opset {self.opset}, {self.experts}); onnxruntime vs torch "
            f"max {checks} tokens; vs full context max {f.max_abs_logit_diff:.3g}, "
            f"top-1 {top1_word(f.top1_match)}"
        )


def ort_session(path: Path):
    """An onnxruntime CPU session of ``path``, its warnings off.

    A patchable file's zero-default factor inputs draw one warning each at session creation
    ("Initializer ... appears in graph inputs"): they are meant to be overridable.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _compare(n: int, got: np.ndarray, want: torch.Tensor) -> tuple[LengthCheck, torch.Tensor]:
    """The figures of one length; ``got`` [1, n, vocab], ``want`` [n, vocab]."""
    if tuple(got.shape) != (1, *want.shape):
        raise CtxcError(
            f"the export gives logits of shape {tuple(got.shape)} at {n} tokens, "
            f"expected {(1, *want.shape)}"
        )
    logits = torch.from_numpy(np.asarray(got[0], dtype=np.float32))  # [n, vocab]
    diff = (logits.double() - want.double()).abs()
    scale = float(want.abs().max())
    worst = float(diff.max())
    check = LengthCheck(
        length=n,
        max_abs_diff=worst,
        mean_abs_diff=float(diff.mean()),
        max_rel_diff=worst / scale if scale > 0 else worst,
        max_abs_logit=scale,
        top1_match=bool((logits.argmax(-1) == want.argmax(-1)).all()),
    )
    return check, logits


def check_lengths(
    run: Callable[[np.ndarray], np.ndarray],
    ids: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    atol: float = ONNX_ATOL,
    artefact: str = "model.onnx",
) -> tuple[tuple[LengthCheck, ...], torch.Tensor]:
    """Run an exported model at each input length and compare with the torch patched model.

    Args:
        run: int64 ids [1, n] -> logits [1, n, vocab] (an onnxruntime session's run).
        ids: the inputs, each [1, n] int64, lengths distinct.
        expected: the torch patched model's logits [n, vocab] for each input.
        atol: the bound on ``max |diff|``, absolute.
        artefact: the checked file's name, for the message.

    Returns:
        the checks, and onnxruntime's logits at the first input [n, vocab].

    Raises:
        CtxcError: a run fails (a length the export fixed) or gives the wrong shape.
        CheckFailed: non-finite values, or a difference above ``atol``.
    """
    checks = []
    first: torch.Tensor | None = None
    for x, want in zip(ids, expected, strict=True):
        n = int(x.shape[1])
        try:
            got = run(x.numpy().astype(np.int64))
        except Exception as exc:  # onnxruntime raises its own types; all mean the same here
            raise CtxcError(
                f"onnxruntime could not run the export at {n} tokens: {root_cause(exc)}"
            ) from None
        check, logits = _compare(n, got, want)
        enforce(  # NaN fails too: non-finite logits
            artefact,
            f"onnxruntime vs the torch patched model at {n} tokens: max |diff|",
            check.max_abs_diff,
            atol,
            f"mean {check.mean_abs_diff:.3g}, {check.max_rel_diff:.3g} of the largest logit",
        )
        checks.append(check)
        if first is None:
            first = logits
    assert first is not None
    return tuple(checks), first


def runtime_floor(
    run: Callable[[np.ndarray], np.ndarray],
    ids: Sequence[torch.Tensor],
    unpatched: Sequence[torch.Tensor],
) -> float:
    """onnxruntime's own distance from torch on the unpatched model (backends/onnx/thresholds.py).

    Args:
        run: int64 ids [1, n] -> the unpatched model's logits [1, n, vocab] in onnxruntime
            (the patchable graph run without factors: their defaults are zero deltas).
        ids: the check inputs.
        unpatched: torch's unpatched logits [n, vocab] for each input.

    Returns:
        ``max |diff|`` over the inputs (NaN when onnxruntime gives a non-finite logit).
    """
    worst = 0.0
    for x, want in zip(ids, unpatched, strict=True):
        got = torch.from_numpy(np.asarray(run(x.numpy().astype(np.int64))[0], np.float32))
        diff = float((got.double() - want.double()).abs().max())
        worst = max(worst, diff) if diff == diff else float("nan")
    return worst


def check_bound(
    atol: float,
    floor: float,
    expected: Sequence[torch.Tensor],
    unpatched: Sequence[torch.Tensor],
    baked: bool,
) -> float:
    """The bound of a check where onnxruntime's floor was measured (backends/onnx/thresholds.py).

    Args:
        atol: the absolute bound.
        floor: onnxruntime's own distance from torch on the unpatched model (:func:`runtime_floor`).
        expected: the torch patched model's logits [n, vocab] for each input.
        unpatched: torch's unpatched logits [n, vocab] at the same inputs.
        baked: a fitted patch (``ctxc bake``), also held to ``ONNX_PATCH_SHARE`` of its effect.

    Returns:
        ``floor_bound(atol, floor, ONNX_FLOOR_FACTOR)``, or for a baked patch the larger of that
        and ``ONNX_PATCH_SHARE * max |expected - unpatched|``.
    """
    bound = floor_bound(atol, floor, ONNX_FLOOR_FACTOR)
    if not baked:
        return bound
    pairs = zip(expected, unpatched, strict=True)
    effect = max(float((e.double() - u.double()).abs().max()) for e, u in pairs)
    return max(bound, ONNX_PATCH_SHARE * effect)


def verify_export(
    path: Path,
    ids: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    full: torch.Tensor,
    *,
    feeds: Callable[[Any], dict[str, np.ndarray]],
    export: dict[str, Any],
    atol: float = ONNX_ATOL,
    unpatched: Sequence[torch.Tensor] | None = None,
    baked: bool = False,
) -> OnnxFigures:
    """Open ``path`` with onnxruntime, check its signature and lengths, gather its figures.

    Args:
        path: the written ``model.onnx``.
        ids: the check inputs (:func:`ctxc.backends.reference.check_ids`).
        expected: the torch patched model's logits [n, vocab] for each input.
        full: the full-context logits at the query positions [k, vocab].
        feeds: session -> the inputs besides ``input_ids`` (the patch's factors, when
            patchable).
        export: the export's own figures, :class:`OnnxFigures` fields: ``patchable``,
            ``opset``, ``external_data``, ``experts``, ``export_seconds``, and optionally
            ``deltas_inserted``.
        atol: the check's absolute bound (see :func:`check_lengths`).
        unpatched: torch's unpatched logits at ``ids``, for a patchable file (run without
            factors it is the unpatched model): the bound becomes
            ``floor_bound(atol, floor, ONNX_FLOOR_FACTOR)`` with onnxruntime's own floor.
        baked: the patch is fitted (``ctxc bake``): with ``unpatched``, the bound is
            :func:`check_bound`'s, a share of the patch's effect included.

    Returns:
        the :class:`OnnxFigures`.

    Raises:
        CtxcError: the signature is not the contract's or a check fails.
    """
    clock = time.perf_counter()
    session = ort_session(path)
    check_signature(session)
    fed = feeds(session)
    floor = None
    if unpatched is not None:
        plain = lambda x: session.run(["logits"], {"input_ids": x})[0]  # noqa: E731
        floor = runtime_floor(plain, ids, unpatched)
        atol = check_bound(atol, floor, expected, unpatched, baked)
    checks, first = check_lengths(
        lambda x: session.run(["logits"], {**fed, "input_ids": x})[0],
        ids,
        expected,
        atol,
        path.name,
    )
    return OnnxFigures(
        file=path.name,
        size_bytes=file_size(path),
        # A patchable file's factor inputs have zero defaults: overridable initializers.
        patch_inputs=len(session.get_inputs()) - 1 + len(session.get_overridable_initializers()),
        checks=checks,
        tolerance=atol,
        fidelity=fidelity(first, full),
        check_seconds=round(time.perf_counter() - clock, 3),
        runtime_floor=floor,
        **{**export, "export_seconds": round(export["export_seconds"], 3)},
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
