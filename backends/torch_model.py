"""Torch backend: the patched model as a plain Transformers directory."""

from __future__ import annotations

from pathlib import Path

import torch

from ctxc.offload import is_dispersed
from ctxc.patch import Patch

__all__ = ["emit_torch", "shard_kwargs"]


def shard_kwargs(model: torch.nn.Module) -> dict:
    """``save_pretrained`` arguments: for a dispersed model, shards of about one block.

    The shard size is the larger of the biggest tensor and the parameters' bytes over the
    number of blocks (``num_hidden_layers``), so a shard never gathers more than a block or
    the one tensor that is bigger (Gemma 3's embedding).
    """
    if not is_dispersed(model):
        return {}
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", 1) or 1
    return {"max_shard_size": max(max(sizes), sum(sizes) // layers)}


def emit_torch(model: torch.nn.Module, tokenizer, patch: Patch, out: Path) -> Path:
    """Write ``out/`` with the patched weights, loadable by ``from_pretrained`` without ctxc.

    The patch is baked with :meth:`Patch.apply` (the weights the solver computed with, bit for
    bit), saved, and removed again: ``model`` is left as it was. A model dispersed by accelerate
    is saved shard by shard, each shard about one block, its offloaded weights read from their
    store as the shard is written (Transformers' ``save_pretrained`` does this for offloaded
    models; ctxc sizes the shards so none gathers more than a block).

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
            model.save_pretrained(str(out), **shard_kwargs(model))
        finally:
            config.use_cache = use_cache
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out
