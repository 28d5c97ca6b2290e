"""Patchable ONNX: one exported model whose patch factors are graph inputs.

The graph takes ``input_ids`` int64 [1, seq] and, for every patched parameter ``P`` (in the
patch's order), ``P::u`` [out, r] and ``P::v`` [in, r], or ``P::vector`` [d], all float32, with
the rank ``r`` dynamic per parameter. It computes the patched weight in the graph exactly as
:meth:`Delta.materialize` does, ``(W.float() + u @ v.T).to(W.dtype)`` (transposed for Conv1D's
``in_out`` layout), so a runtime can feed any context's patch to the same file without exporting
again. The input names are the tensor names of ``patch.safetensors``: :func:`patch_feeds` turns a
patch (or its file) into the feed dict.

A zero delta leaves a weight exactly as it was (``W.float() + 0`` rounds back to ``W``), so a
parameter a patch does not touch is fed zeros (:func:`patch_feeds` with the model does that), and
the all-zero feed is the unpatched model.

Why not :func:`~ctxc.passes.runtime.insert_deltas.insert_deltas` with the factors as graph inputs:
the
pass works on an unlifted GraphModule, whose inputs are fixed by the pytree spec of the first
export; adding inputs would mean rewriting that spec and the placeholders by hand. Here the
wrapper's ``forward(input_ids, *factors)`` gives ``torch.export`` the inputs directly, and
``functional_call`` substitutes the patched weights without writing into the model, so neither
route modifies the model. The factor slots also differ from a patch's deltas (a whole expert bank,
a dynamic rank), which the baked pass has no reason to know about.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.export import Dim
from torch.func import functional_call

from ctxc.backends.onnx.check import ONNX_ATOL, OnnxFigures, verify_export
from ctxc.backends.onnx.export import (
    export_program,
    export_settings,
    patched_logits,
    require_onnx,
    seq_dim,
)
from ctxc.backends.onnx.files import ONNX_FILE, patch_metadata, save_program
from ctxc.backends.reference import check_ids, reference_logits, torch_logits
from ctxc.core.delta_math import add_in_float32, lowrank_dense
from ctxc.core.errors import CtxcError
from ctxc.patch import Delta, Patch

__all__ = [
    "Slot",
    "emit_onnx_patchable",
    "input_name",
    "inputs_of",
    "patch_feeds",
    "slots_of",
    "zero_defaults",
]

# torch.export specialises a dimension whose example size is 0 or 1: trace with rank >= 2
# (extra zero columns add exact zeros to u @ v.T).
_EXAMPLE_RANK = 2


def input_name(param: str, part: str) -> str:
    """The graph input of one factor: ``<param>::u``, ``::v`` or ``::vector``.

    The same names as the tensors of ``patch.safetensors`` (:meth:`Patch.save`).
    """
    return f"{param}::{part}"


@dataclass(frozen=True)
class Slot:
    """One patchable parameter of the exported graph.

    Attributes:
        param: the parameter name (``model.layers.0.mlp.down_proj.weight``).
        kind: ``"factors"`` (inputs ``::u`` [out, r], ``::v`` [in, r]) or ``"vector"`` [d].
        layout: ``"out_in"`` or ``"in_out"`` (the weight stores ``dW.T``).
        experts: the size E of a stacked expert bank [E, ., .] (its factors are then
            [E, out, r] and [E, in, r], zero for the experts a patch leaves alone); 0 otherwise.
    """

    param: str
    kind: str
    layout: str = "out_in"
    experts: int = 0

    @property
    def inputs(self) -> tuple[str, ...]:
        parts = ("vector",) if self.kind == "vector" else ("u", "v")
        return tuple(input_name(self.param, p) for p in parts)


def slots_of(model: torch.nn.Module, patch: Patch) -> tuple[Slot, ...]:
    """The slots ``patch`` fills, in its order (a vector wins over factors, as in Delta.dense).

    An expert-bank delta's slot covers every expert of the bank, so a patch that changes other
    experts fits the same graph.
    """
    return tuple(
        Slot(
            name,
            "vector" if d.vector is not None else "factors",
            d.layout,
            int(model.get_parameter(name).shape[0]) if d.experts else 0,
        )
        for name, d in patch.deltas.items()
    )


class _Patchable(torch.nn.Module):
    """``forward(input_ids, *factors) -> logits``: the model with in-graph patched weights."""

    def __init__(self, model: torch.nn.Module, slots: tuple[Slot, ...]) -> None:
        super().__init__()
        self.model = model
        self.slots = slots

    def forward(self, input_ids: torch.Tensor, *factors: torch.Tensor) -> torch.Tensor:
        it = iter(factors)
        params: dict[str, torch.Tensor] = {}
        for slot in self.slots:
            base = self.model.get_parameter(slot.param)
            if slot.kind == "vector":
                dense = next(it)
            else:
                u, v = next(it), next(it)
                dense = lowrank_dense(u, v, slot.layout)  # [out, in] (or [E, out, in])
            # Delta.materialize, op for op (an expert bank's untouched experts add exact zeros).
            params[slot.param] = add_in_float32(base, dense)
        return functional_call(self.model, params, (), {"input_ids": input_ids}).logits


def _example(slots: tuple[Slot, ...], patch: Patch) -> list[torch.Tensor]:
    """Factor tensors for tracing: the patch's own, on the whole bank, zero-padded to rank >= 2."""
    out: list[torch.Tensor] = []
    for slot in slots:
        d = patch.deltas[slot.param]
        if slot.kind == "vector":
            assert d.vector is not None
            out.append(d.vector.detach().float().cpu())
            continue
        assert d.u is not None and d.v is not None
        rank = max(_EXAMPLE_RANK, d.rank)
        for f in (d.u, d.v):
            f = f.detach().float().cpu()
            if not slot.experts:
                out.append(torch.cat([f, f.new_zeros(f.shape[0], rank - d.rank)], 1))
                continue
            bank = f.new_zeros(slot.experts, f.shape[1], rank)
            bank[list(d.experts), :, : d.rank] = f
            out.append(bank)
    return out


def _factor_dims(slots: tuple[Slot, ...]) -> tuple[dict, ...]:
    """The dynamic shapes of the factor inputs: the rank of each pair, shared by u and v."""
    dims: list[dict] = []
    for i, slot in enumerate(slots):
        if slot.kind == "vector":
            dims.append({})
        else:
            rank = Dim(f"rank_{i}", min=1)
            axis = 2 if slot.experts else 1  # [E, out, r] for a bank, else [out, r]
            dims += [{axis: rank}, {axis: rank}]
    return tuple(dims)


def emit_onnx_patchable(
    model: torch.nn.Module,
    patch: Patch,
    out: Path,
    *,
    full: torch.Tensor | None = None,
    opset: int | None = None,
    external_data: bool | None = None,
    atol: float = ONNX_ATOL,
    name: str = ONNX_FILE,
) -> tuple[Path, OnnxFigures]:
    """Write ``out/model.onnx`` with the base weights baked and ``patch``'s slots as inputs.

    The slots (which parameters, factors or vector, layout) are ``patch``'s; any patch whose
    deltas lie within them can be fed (:func:`patch_feeds` fills the rest with zeros). ``model``
    is not modified (its parameters are neither written nor replaced). The file is checked by
    onnxruntime, fed ``patch``, at the query's length and at a longer one against the torch
    patched model.

    Args:
        model: the model the patch was computed on.
        patch: the patch that defines the slots and is fed for the check.
        out: the folder to write (created).
        full: the full-context logits at the query positions [k, vocab], if already computed.
        opset: the ONNX opset (default: the exporter's).
        external_data: force or forbid ``model.onnx.data`` (default: only past 2 GB).
        atol: the check's absolute bound on ``max |logits_ort - logits_torch|``.
        name: the file name (``model.onnx``; the ORT adapter backend writes ``patchable.onnx``).

    Returns:
        the path of the file and its :class:`OnnxFigures` (``patchable=True``).

    Raises:
        CtxcError: the export or its check failed.
    """
    require_onnx()
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    slots = slots_of(model, patch)
    ids = check_ids(patch)
    names = ["input_ids"] + [n for s in slots for n in s.inputs]
    clock = time.perf_counter()
    with export_settings(model) as experts:
        if full is None:
            full = reference_logits(model, patch)
        expected = patched_logits(model, patch, ids)
        unpatched = torch_logits(model, ids)  # onnxruntime's floor (onnx/thresholds.py)
        program = export_program(
            _Patchable(model, slots).eval(),
            (ids[-1], *_example(slots, patch)),
            ({1: seq_dim(model)}, _factor_dims(slots)),  # forward(input_ids, *factors)
            names,
            opset,
        )
        zero_defaults(program.model.graph)
        metadata = patch_metadata(model, patch, True)
        metadata["ctxc.slots"] = json.dumps([vars(s) for s in slots])
        external = save_program(program, path, metadata, external_data)
        opset_used = int(program.model.opset_imports.get("", 0))
        del program
    export = {
        "patchable": True,
        "opset": opset_used,
        "external_data": external,
        "experts": experts,
        "export_seconds": time.perf_counter() - clock,
    }
    figures = verify_export(
        path,
        ids,
        expected,
        full,
        feeds=lambda session: patch_feeds(patch, session),
        export=export,
        atol=atol,
        unpatched=unpatched,
        baked=patch.meta.baked,
    )
    return path, figures


def patch_feeds(patch: Patch | str | Path, model=None) -> dict[str, np.ndarray]:
    """The feed dict of a patch for a patchable ``model.onnx`` (without ``input_ids``).

    Args:
        patch: a :class:`Patch`, or the path of a ``patch.safetensors``.
        model: the patchable ``model.onnx`` (path) or an onnxruntime session of it; optional
            unless the patch changes a stacked expert bank (its feed spans the whole bank).
            When given, the patch's fingerprint must be the model's, every delta must have its
            inputs, and the inputs the patch does not fill get zeros (a zero delta is exact).

    Returns:
        input name -> float32 array: ``P::u`` [out, r], ``P::v`` [in, r] (an expert bank's
        [E, out, r], [E, in, r], zero for experts the patch leaves alone), ``P::vector`` [d].

    Raises:
        CtxcError: an unreadable patch, or one that does not fit ``model``.
    """
    if not isinstance(patch, Patch):
        patch = Patch.load(patch)
    shapes: dict[str, list] | None = None
    if model is not None:
        shapes, meta = inputs_of(model)
        fp = meta.get("ctxc.models.fingerprint")
        if fp is not None and json.loads(fp) != patch.meta.fingerprint:
            raise CtxcError(
                "patch does not fit this ONNX model: it was computed on another model "
                "(fingerprints differ)"
            )
    feeds: dict[str, np.ndarray] = {}
    for name, delta in patch.deltas.items():
        for part, tensor in _parts(delta).items():
            key = input_name(name, part)
            if shapes is not None and key not in shapes:
                raise CtxcError(
                    f"the ONNX model has no input {key}: export it patchable from a patch "
                    "that changes this parameter"
                )
            array = tensor.detach().float().cpu().numpy()
            if delta.experts:
                if shapes is None:
                    raise CtxcError(
                        f"{name} is an expert bank: pass the ONNX model to patch_feeds to size "
                        "its feed"
                    )
                bank = np.zeros([shapes[key][0], *array.shape[1:]], np.float32)
                bank[list(delta.experts)] = array
                array = bank
            feeds[key] = array
    if shapes is None:
        return feeds
    for key, shape in shapes.items():
        if key == "input_ids" or key in feeds:
            continue
        # Static dimensions are the weight's; the dynamic one is the rank: a rank-1 zero delta.
        feeds[key] = np.zeros([d if isinstance(d, int) else 1 for d in shape], np.float32)
    for key, array in feeds.items():
        want = shapes[key]
        if len(want) != array.ndim or any(
            isinstance(w, int) and w != g for w, g in zip(want, array.shape, strict=True)
        ):
            raise CtxcError(f"patch factor {key} has shape {array.shape}, the model wants {want}")
    return feeds


def zero_defaults(graph) -> None:
    """Give every factor input a zero initializer of rank 1: the input becomes optional.

    An input that is also an initializer is overridable (ONNX IR 4+): a run that does not feed
    it reads zeros, the exact zero delta (the unpatched model). onnxruntime's adapters
    (:mod:`ctxc.backends.onnx.ort_adapter`) need it: a session checks that every required input is
    fed before it reads the active adapters' tensors. Mutates ``graph`` (an ``onnx_ir.Graph``).
    """
    import onnx_ir as ir

    for value in graph.inputs[1:]:  # after input_ids: the factors
        shape = [d if isinstance(d, int) else 1 for d in value.shape.dims]
        value.const_value = ir.tensor(np.zeros(shape, np.float32), name=value.name)
        graph.register_initializer(value)


def _parts(delta: Delta) -> dict[str, torch.Tensor]:
    if delta.vector is not None:
        return {"vector": delta.vector}
    assert delta.u is not None and delta.v is not None
    return {"u": delta.u, "v": delta.v}


def inputs_of(model) -> tuple[dict[str, list], dict[str, str]]:
    """Input name -> shape (ints, or str for a dynamic dimension), and the metadata_props.

    Args:
        model: a ``model.onnx`` path (read without its external data) or an onnxruntime
            session.
    """
    if isinstance(model, str | Path):
        import onnx

        proto = onnx.load(str(model), load_external_data=False)
        shapes = {
            i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in proto.graph.input
        }
        return shapes, {p.key: p.value for p in proto.metadata_props}
    # Factor inputs with a zero default are overridable initializers, not required inputs.
    listed = [*model.get_inputs(), *model.get_overridable_initializers()]
    shapes = {i.name: list(i.shape) for i in listed}
    return shapes, dict(model.get_modelmeta().custom_metadata_map)
