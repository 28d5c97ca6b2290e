"""ONNX export machinery shared by the baked and the patchable emitters.

The baked route (:func:`patched_graph`, then :func:`export_program`):

1. ``ctxc.frontend.trace.trace(model)`` under :func:`export_settings` (no KV cache, an exportable
MoE
   expert implementation): a ``torch.export`` of the logits-only wrapper, sequence length dynamic;
   the process's own export of a dense model when a compile made it (:func:`reusable_export`).
2. ``program.module()``: the unlifted ``GraphModule``. Its parameters are ``get_attr`` nodes that
   read the model's own tensors (shared, not copied).
3. :func:`ctxc.passes.runtime.insert_deltas.insert_deltas` mutates that GraphModule: the patch's
factors
   become new frozen parameters of the GraphModule, and nodes computing
   ``(W.float() + u v^T).to(W.dtype)`` (``Delta.materialize``, op for op) feed every reader of
   ``W``. The model's tensors are never written, so the export cannot leave the model modified,
   and the file does not have to be written while a patch is applied.
4. ``torch.onnx.export(gm, dynamo=True)`` re-exports the GraphModule (an ``nn.Module`` like any
   other) with the same dynamic ``seq`` dimension. Handing the exporter the first
   ``ExportedProgram`` instead would need the new parameters spliced into its lifted graph
   signature by hand; re-exporting a GraphModule is supported by ``torch.export``, cheap (there
   is no Transformers Python left to run) and lets the exporter lift the new parameters itself.
   The example input must be at least 2 tokens long: ``torch.export`` specialises a dimension
   whose example size is 1, and the file would then take one length only.

The exporter's optimizer folds the inserted nodes into plain initializers when their inputs are
small (onnxscript folds tensors up to 8192 elements); for larger weights the file keeps
``W``, ``u``, ``v`` and the Cast/MatMul/Add over them, which onnxruntime's constant folding
evaluates once when a session is created, so inference costs what a baked file costs.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind
from torch.func import functional_call

from ctxc.backends.base import require_installed
from ctxc.backends.onnx.facts import EXTRA, NAME, REQUIRES
from ctxc.core.errors import CtxcError
from ctxc.frontend.trace import MAX_SEQ, WRAPPED, longest_input, no_cache, trace
from ctxc.passes.runtime.insert_deltas import InsertResult, insert_deltas
from ctxc.patch import Patch
from ctxc.store.traced import shared_program

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "EXPORTABLE_EXPERTS",
    "experts_implementation",
    "export_program",
    "export_settings",
    "patched_graph",
    "patched_logits",
    "require_onnx",
    "reusable_export",
    "root_cause",
    "seq_dim",
]

# The exporter's own tracing would stop at the others; a dense rewrite exports (block-shapes.md).
EXPORTABLE_EXPERTS = "batched_mm"


def require_onnx() -> None:
    """Raise a one-line CtxcError when the ONNX extras are not installed."""
    require_installed(NAME, REQUIRES, EXTRA)


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
    ``batched_mm`` (index + bmm) exports (block-shapes.md, export facts). The model is left in
    eval mode, as :func:`ctxc.frontend.trace.trace` leaves it. No parameter is touched.

    Yields:
        the expert implementation in force (``"dense"`` for a dense model), for the report.
    """
    model.eval()
    before = experts_implementation(model)
    used = before
    # Not "dense": a Transformers model that can set its expert implementation.
    experts = cast("PreTrainedModel", model)
    if before not in ("dense", EXPORTABLE_EXPERTS):
        experts.set_experts_implementation(EXPORTABLE_EXPERTS)
        used = f"{EXPORTABLE_EXPERTS} (the model's {before} does not export to ONNX)"
    try:
        with no_cache(model):
            yield used
    finally:
        if used != before:
            experts.set_experts_implementation(before)


def seq_dim(model: torch.nn.Module) -> Dim:
    """The dynamic sequence dimension, bounded as :func:`ctxc.frontend.trace.trace` bounds it."""
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None) or MAX_SEQ
    return Dim("seq", min=1, max=max(2, min(int(max_pos), MAX_SEQ)))


def patched_graph(model: torch.nn.Module, patch: Patch) -> InsertResult:
    """The model's graph with ``patch`` inserted as in-graph deltas; ``model`` is not modified.

    Call it under :func:`export_settings` (the trace must see the exportable experts).

    Args:
        model: the model the patch was computed on.
        patch: the patch to insert (expert-bank deltas included).

    Returns:
        :func:`insert_deltas`'s result: ``gm`` computes ``input_ids`` [1, seq] -> logits
        [1, seq, vocab] of the patched model, reading the model's own (unchanged) tensors.
    """
    # The compile of this process traced the model already (the same call, see
    # reusable_export): a second torch.export of it is a quarter of a small model's ONNX export.
    program = reusable_export(model) or trace(model).program
    assert isinstance(program, ExportedProgram)  # a fresh export, not the export cache's
    # module() unlifts a copy of the graph: insert_deltas never edits the shared export.
    return insert_deltas(program.module(), patch)


def reusable_export(model: torch.nn.Module) -> ExportedProgram | None:
    """The process's shared export of ``model`` when it is what ``trace(model)`` would make now.

    :func:`ctxc.store.traced.traced_blocks` keeps one export per model; its dynamic rung is the
    call ``trace(model)`` makes (the whole ``seq`` range, the same example), so the graph is the
    same while the model is. It is not reused for a model with MoE experts (its experts
    implementation may have been another at that trace), a graph loaded from the export cache
    (not an ``ExportedProgram``), a dispersed model (traced on a meta skeleton), or when any
    parameter or buffer the graph reads is no longer the model's own tensor (replaced since).

    Args:
        model: the model, under :func:`export_settings`.

    Returns:
        the ``ExportedProgram``, or None: trace afresh.
    """
    found = shared_program(model)
    if found is None or experts_implementation(model) != "dense":
        return None
    traced = found[0]
    program = traced.program
    if not isinstance(program, ExportedProgram) or traced.source is not None:
        return None
    if (traced.frontend, traced.seq_range) != ("dynamic", (1, longest_input(model))):
        return None
    prefix = WRAPPED + "."
    for spec in program.graph_signature.input_specs:
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER) or spec.target is None:
            continue
        name = spec.target.removeprefix(prefix)
        held = program.state_dict.get(spec.target, program.constants.get(spec.target))
        try:
            if spec.kind == InputKind.PARAMETER:
                live: torch.Tensor = model.get_parameter(name)
            else:
                live = model.get_buffer(name)
        except AttributeError:  # no longer the model's: the graph would read a stale tensor
            return None
        if held is not live:
            return None
    return program


def patched_logits(
    model: torch.nn.Module, patch: Patch, ids: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The torch patched model's logits, computed without writing into ``model``.

    ``torch.func.functional_call`` runs ``model`` with each patched parameter replaced by
    ``Delta.materialize`` of it: the weights ``Patch.apply`` would write, bit for bit.

    Args:
        model: the model the patch was computed on.
        patch: the patch.
        ids: int64 inputs, each [1, n].

    Returns:
        float32 [n, vocab] on the CPU, one per input.
    """
    device = next(model.parameters()).device
    with torch.no_grad():
        params = {n: d.materialize(model.get_parameter(n)) for n, d in patch.deltas.items()}
        return [
            functional_call(model, params, (), {"input_ids": x.to(device)}).logits[0].float().cpu()
            for x in ids
        ]


def root_cause(exc: BaseException) -> str:
    """The first line of the innermost cause, without terminal colour codes."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def export_program(
    module: torch.nn.Module,
    args: tuple,
    dynamic_shapes: tuple,
    input_names: Sequence[str],
    opset: int | None,
):
    """``torch.onnx.export(..., dynamo=True)``; any failure becomes a one-line CtxcError.

    Args:
        module: what to export (a GraphModule from :func:`patched_graph`, or any module).
        args: example inputs; the sequence length at least 2 (1 would be specialised).
        dynamic_shapes: per input, axis -> ``Dim``.
        input_names: the graph input names, in ``args`` order.
        opset: the ONNX opset (None: the exporter's default).

    Returns:
        the ``torch.onnx.ONNXProgram``; its initializers alias ``module``'s tensors.
    """
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # Dims shared by several inputs (a patch factor pair's rank) draw one warning each.
            warnings.filterwarnings("ignore", message=r"# The axis name")
            # An exported program's GraphModule reports training mode and refuses eval(); its
            # graph was traced in eval mode (trace() sets it), so the flag changes nothing.
            warnings.filterwarnings("ignore", message=r"Exporting a model while it is in training")
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
        raise CtxcError(f"ONNX export failed: {root_cause(exc)}") from exc
