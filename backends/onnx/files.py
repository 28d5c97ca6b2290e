"""Writing an exported ONNX program: the file, its metadata and its external data."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ctxc._version import __version__
from ctxc.patch import Patch

__all__ = ["ONNX_FILE", "file_size", "patch_metadata", "save_program"]

ONNX_FILE = "model.onnx"


def save_program(program, path: Path, metadata: dict[str, str], external_data: bool | None) -> bool:
    """Write ``program`` to ``path`` with ``metadata``; returns whether the weights went external.

    Args:
        program: a ``torch.onnx.ONNXProgram``.
        path: the ``model.onnx`` to write.
        metadata: ONNX ``metadata_props`` (:func:`patch_metadata`).
        external_data: force (True) or forbid (False) ``<path>.data``; None leaves the choice
            to the exporter, which moves the weights there when the file would pass 2 GB.
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
        "ctxc.models.fingerprint": json.dumps(m.fingerprint),
        "ctxc.update": m.update,
        "ctxc.context_ids": json.dumps(m.context_ids),
        "ctxc.query_ids": json.dumps(m.query_ids),
    }


def file_size(path: Path) -> int:
    """``path`` plus its external data file, in bytes."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)
