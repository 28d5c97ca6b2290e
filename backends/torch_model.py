"""Torch backend: the patched model as a plain Transformers directory."""

from __future__ import annotations

from pathlib import Path

import torch

from ctxc.patch import Patch

__all__ = ["emit_torch"]


def emit_torch(model: torch.nn.Module, tokenizer, patch: Patch, out: Path) -> Path:
    """Write ``out/`` with the patched weights, loadable by ``from_pretrained`` without ctxc.

    The patch is baked with :meth:`Patch.apply` (the weights the solver computed with, bit for
    bit), saved, and removed again: ``model`` is left as it was.

    Args:
        model: the model the patch was computed on.
        tokenizer: saved beside the weights, when given.
        patch: the patch to bake.
        out: the directory to write (created).

    Returns:
        ``out``.
    """
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    use_cache = config.use_cache
    with patch.applied(model, check=False):
        try:
            config.use_cache = True  # ctxc turns the cache off for export; users generate with it
            model.save_pretrained(str(out))
        finally:
            config.use_cache = use_cache
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
