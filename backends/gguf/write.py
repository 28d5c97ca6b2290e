"""A model's weights as it is now, written to a GGUF file that llama.cpp loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ctxc.backends.gguf.metadata import copy_metadata, write_metadata
from ctxc.backends.gguf.names import gguf_arch, gguf_tensors
from ctxc.core.vocabulary import GGUF_F32
from ctxc.models.load import source_gguf

__all__ = ["tensor_array", "write_gguf"]


def tensor_array(w: np.ndarray, gguf_type: str):
    """``(data, raw_dtype)`` for ``GGUFWriter.add_tensor``: matrices in ``gguf_type``, else F32."""
    import gguf

    if w.ndim < 2 or gguf_type == GGUF_F32:
        return w.astype(np.float32), None
    if gguf_type == "F16":
        return w.astype(np.float16), None
    bf16 = gguf.GGMLQuantizationType.BF16
    return gguf.quants.quantize(w.astype(np.float32), bf16), bf16


def write_gguf(model, tokenizer, path: Path, gguf_type: str = GGUF_F32) -> tuple[int, str]:
    """Write ``model`` as it is now (no patch applied here) to the GGUF file ``path``.

    Args:
        model: a model of a known architecture (:func:`gguf_arch`).
        tokenizer: its tokenizer (unused when the model came from a GGUF file).
        path: the file to write.
        gguf_type: ``F32``, ``F16`` or ``BF16`` for the matrices.

    Returns:
        ``(tensors written, where the metadata came from)``.
    """
    import gguf

    arch = gguf_arch(model)
    writer = gguf.GGUFWriter(str(path), arch.arch)
    source = source_gguf(model)
    if source is not None:
        copy_metadata(writer, source)
        metadata = f"source GGUF {source.name}"
    else:
        write_metadata(writer, model, tokenizer, arch)
        metadata = "config"
    file_types = {"F32": 0, "F16": 1, "BF16": 32}  # llama.cpp's LlamaFileType
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_file_type(file_types[gguf_type])
    count = 0
    for name, w in gguf_tensors(model, arch):
        data, raw = tensor_array(w, gguf_type)
        writer.add_tensor(name, data, raw_dtype=raw)
        count += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return count, metadata
