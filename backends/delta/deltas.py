"""Dense weight deltas: one float32 tensor per patched parameter, under the parameter's name.

``deltas.safetensors`` holds, for every parameter the patch changes, ``delta`` of the
parameter's own name and shape (an expert bank's whole ``[E, out, in]``, zero for the experts
the patch leaves alone), so that any tool that reads safetensors patches the base model as
ctxc does, without ctxc: ``W = (W.float() + delta).to(W.dtype)`` (``Delta.materialize``). The
file's metadata says so (``apply``) and names the model, its dtype and the update rule.

The check reads the file back as a user would (``safetensors.torch.load_file``), adds each
delta to the model's parameter that way and runs the query through the model with those
weights (``torch.func.functional_call``: the model's own tensors are only read); its logits
must reproduce ctxc's patched model within the reload bound, and its fidelity to the full
context is held to the patch's figure by the emit loop's gate.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ctxc.backends.reference import check_ids, reference_logits
from ctxc.backends.thresholds import reload_bound
from ctxc.core.checks import enforce
from ctxc.core.delta_math import add_in_float32, at_alignment_of
from ctxc.core.errors import CtxcError
from ctxc.core.metrics import Fidelity, fidelity, top1_word
from ctxc.models.offload import input_device
from ctxc.patch import Patch
from ctxc.runs.patched_forward import patched_logits

__all__ = ["APPLY", "DELTAS_FILE", "DeltaFigures", "check_deltas", "emit_deltas", "write_deltas"]

DELTAS_FILE = "deltas.safetensors"
# How a delta is applied, as the file's metadata says it.
APPLY = "W = (W.float() + delta).to(W.dtype)"


@dataclass(frozen=True)
class DeltaFigures:
    """What ``deltas.safetensors`` holds and how the model with its deltas added reproduces ctxc.

    Attributes:
        file: the file, relative to the output folder.
        tensors: the deltas written (one per patched parameter).
        size_bytes: the file's size.
        applied: the model with the file's deltas added, fed the query alone, against the full
            context.
        applied_vs_patched: max |logit diff| of the same from ctxc's patched model in memory.
        tolerance: the bound ``applied_vs_patched`` met (``reload_bound``).
        seconds: wall time of writing and checking.
    """

    file: str
    tensors: int
    size_bytes: int
    applied: Fidelity
    applied_vs_patched: float
    tolerance: float
    seconds: float

    def to_dict(self) -> dict:
        """The JSON form written under ``"safetensors-delta"`` in ``report.json``."""
        return asdict(self)

    def fidelities(self) -> dict[str, Fidelity]:
        """The model with the deltas added, held to the patch's figure by the gate."""
        return {"applied": self.applied}

    def summary(self) -> str:
        """One line for a terminal."""
        a = self.applied
        return (
            f"safetensors-delta: {self.file} ({self.tensors} tensors, "
            f"{self.size_bytes / 2**20:.1f} MiB); added to the model vs ctxc's patched model max "
            f"{self.applied_vs_patched:.3g}; vs full context max {a.max_abs_logit_diff:.3g}, "
            f"top-1 {top1_word(a.top1_match)}"
        )


def write_deltas(model: torch.nn.Module, patch: Patch, path: Path) -> int:
    """Write every delta of ``patch`` dense, in its parameter's shape, to ``path``.

    Args:
        model: the model the patch was computed on (its parameters' shapes are read).
        patch: the patch.
        path: the file to write.

    Returns:
        the number of tensors written.
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, delta in patch.deltas.items():
        dense = delta.dense().float().cpu()
        if delta.experts:  # the listed experts' slices: spread over the whole bank
            bank = torch.zeros(model.get_parameter(name).shape, dtype=torch.float32)
            bank[list(delta.experts)] = dense
            dense = bank
        tensors[name] = dense.contiguous()
    meta = patch.meta
    save_file(
        tensors,
        str(path),
        metadata={
            "format": "ctxc weight deltas",
            "apply": APPLY,
            "model": meta.model,
            "dtype": meta.dtype,
            "update": meta.update,
            "ctxc_version": meta.ctxc_version,
        },
    )
    return len(tensors)


def _added(model: torch.nn.Module, deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's parameters with the file's deltas added (:data:`APPLY`), by name.

    Each value sits at its parameter's address modulo 64 bytes (``at_alignment_of``), as a
    weight written in place does: CPU kernels round by alignment.

    Raises:
        CtxcError: a tensor that names no parameter of the model, or of another shape.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    values = {}
    for name, delta in deltas.items():
        param = params.get(name)
        if param is None or tuple(param.shape) != tuple(delta.shape):
            got = "no parameter" if param is None else f"shape {tuple(param.shape)}"
            raise CtxcError(f"{name} of shape {tuple(delta.shape)} fits {got} of the model")
        value = add_in_float32(param.detach(), delta.to(param.device))
        values[name] = at_alignment_of(value, param)
    return values


def check_deltas(
    model: torch.nn.Module,
    patch: Patch,
    path: Path,
    full: torch.Tensor,
    baked: torch.Tensor | None = None,
) -> tuple[Fidelity, float, float]:
    """The file read back, its deltas added to the model's weights, fed the query.

    Args:
        model: the model the patch was computed on (only read).
        patch: the patch (its query is fed; ctxc's patched model is its reference).
        path: the written ``deltas.safetensors``.
        full: the full-context logits at the query positions [k, vocab].
        baked: ctxc's patched model fed the query [k, vocab], if computed.

    Returns:
        the fidelity to ``full``, the max |logit diff| from ctxc's patched model, its bound.

    Raises:
        CtxcError: a tensor fits no parameter; CheckFailed: the logits are beyond the bound
            from ctxc's patched model (or non-finite).
    """
    values = _added(model, load_file(str(path)))
    query = check_ids(patch)[0].to(input_device(model))
    if baked is None:
        baked = patched_logits(model, patch, query)
    baked = baked.float().cpu()
    with torch.no_grad():
        out = torch.func.functional_call(model, values, args=(), kwargs={"input_ids": query})
    logits = out.logits[0].float().cpu()
    diff = float((logits - baked).abs().max())
    bound = reload_bound(patch.meta.dtype, float(baked.abs().max()))
    enforce(
        path.name,
        "max |logit diff| of the model with its deltas added from ctxc's patched model",
        diff,
        bound,
    )
    return fidelity(logits, full.float().cpu()), diff, bound


def emit_deltas(
    model: torch.nn.Module,
    patch: Patch,
    out: Path,
    *,
    full: torch.Tensor | None = None,
    baked: torch.Tensor | None = None,
) -> tuple[Path, DeltaFigures]:
    """Write ``out/deltas.safetensors`` and check it added to the model.

    Args:
        model: the model the patch was computed on (not modified).
        patch: the patch.
        out: the artefact's staging folder.
        full: the full-context logits at the query positions [k, vocab], if computed.
        baked: ctxc's patched model fed the query [k, vocab], if computed (``ctxc compile``'s).

    Returns:
        the file and its :class:`DeltaFigures`.

    Raises:
        CtxcError: the file does not fit the model; CheckFailed: it does not reproduce ctxc's
            patched model.
    """
    clock = time.perf_counter()
    if full is None:
        full = reference_logits(model, patch)
    path = out / DELTAS_FILE
    tensors = write_deltas(model, patch, path)
    applied, diff, bound = check_deltas(model, patch, path, full, baked)
    return path, DeltaFigures(
        file=DELTAS_FILE,
        tensors=tensors,
        size_bytes=path.stat().st_size,
        applied=applied,
        applied_vs_patched=diff,
        tolerance=bound,
        seconds=round(time.perf_counter() - clock, 3),
    )
