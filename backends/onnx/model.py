"""ONNX backend: the patched model as ``model.onnx``, the patch baked into the graph.

The model is traced, :func:`~ctxc.passes.runtime.insert_deltas.insert_deltas` adds the patch to the
graph as in-graph deltas computing ``(W.float() + u v^T).to(W.dtype)`` (what ``Patch.apply``
writes), and that GraphModule is exported with ``torch.onnx.export(..., dynamo=True)`` and a
dynamic sequence length (the route and why: :mod:`ctxc.backends.onnx.export`). The model's own
tensors are read, never written: no patch is applied to it at any point. The file is then run
by onnxruntime at two input lengths against the torch patched model
(:mod:`ctxc.backends.onnx.check`); a failed check raises.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ctxc.backends.onnx.check import ONNX_ATOL, OnnxFigures, verify_export
from ctxc.backends.onnx.export import (
    export_program,
    export_settings,
    patched_graph,
    patched_logits,
    require_onnx,
    seq_dim,
)
from ctxc.backends.onnx.files import ONNX_FILE, patch_metadata, save_program
from ctxc.backends.reference import check_ids, reference_logits
from ctxc.patch import Patch

# The CLI reaches the backend through this module: require_onnx and ONNX_FILE stay importable.
__all__ = ["ONNX_ATOL", "ONNX_FILE", "OnnxFigures", "emit_onnx", "require_onnx"]


def emit_onnx(
    model: torch.nn.Module,
    patch: Patch,
    out: Path,
    *,
    full: torch.Tensor | None = None,
    opset: int | None = None,
    external_data: bool | None = None,
    atol: float = ONNX_ATOL,
) -> tuple[Path, OnnxFigures]:
    """Write ``out/model.onnx``: the patched model, ``input_ids`` int64 [1, seq] -> ``logits``.

    The patch is inserted into a trace of ``model`` (expert banks included) and baked into the
    exported graph; ``model``'s parameters are neither written nor replaced. The file is checked
    by onnxruntime at the query's length and at a longer one against the torch patched model.

    Args:
        model: the model the patch was computed on (not checked: the caller has done so).
        patch: the patch to bake.
        out: the folder to write (created).
        full: the full-context logits at the query positions [k, vocab], if already computed
            (default: computed here with :func:`reference_logits`).
        opset: the ONNX opset (default: the exporter's).
        external_data: force (True) or forbid (False) ``model.onnx.data``; default: only when
            the file would pass 2 GB.
        atol: the check's absolute bound on ``max |logits_ort - logits_torch|``.

    Returns:
        the path of ``model.onnx`` and its :class:`OnnxFigures`.

    Raises:
        CtxcError: the export or its check failed (the file may have been written).
    """
    require_onnx()
    out.mkdir(parents=True, exist_ok=True)
    path = out / ONNX_FILE
    ids = check_ids(patch)  # [query [1, k], tail [1, n]], n >= 2
    clock = time.perf_counter()
    with export_settings(model) as experts:
        if full is None:
            full = reference_logits(model, patch)
        expected = patched_logits(model, patch, ids)
        inserted = patched_graph(model, patch)
        # The longer input is the example: a length-1 example would fix the length at 1.
        program = export_program(
            inserted.gm, (ids[-1],), ({1: seq_dim(model)},), ["input_ids"], opset
        )
        external = save_program(program, path, patch_metadata(model, patch, False), external_data)
        opset_used = int(program.model.opset_imports.get("", 0))
        replaced = inserted.replaced  # one per delta: insert_deltas refuses a patch it cannot place
        del program, inserted
    export = {
        "patchable": False,
        "opset": opset_used,
        "external_data": external,
        "experts": experts,
        "export_seconds": time.perf_counter() - clock,
        "deltas_inserted": replaced,
    }
    figures = verify_export(path, ids, expected, full, feeds=lambda _: {}, export=export, atol=atol)
    return path, figures
