"""Torch backend: the patched model as a plain Transformers directory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ctxc.backends.torch.shards import (
    realign_shards,
    source_alignments,
    write_shards,
    write_split,
)
from ctxc.models.offload import is_dispersed
from ctxc.patch import Patch
from ctxc.runs.patched_forward import patched_values
from ctxc.store import frozen_shards

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["emit_torch", "save_tokenizer", "shard_kwargs"]


def shard_kwargs(model: torch.nn.Module) -> dict:
    """``save_pretrained`` arguments: for a dispersed model, shards of about one block.

    The shard size is the parameters' bytes over the number of blocks (``num_hidden_layers``),
    so a shard never gathers more than about a block, or the one tensor that is bigger (Gemma
    3's embedding, alone in its shard).
    """
    if not is_dispersed(model):
        return {}
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    layers = getattr(getattr(model, "config", None), "num_hidden_layers", 1) or 1
    # A tensor larger than this gets a shard of its own (Transformers' rule).
    return {"max_shard_size": max(1, sum(sizes) // layers)}


def emit_torch(model: PreTrainedModel, tokenizer, patch: Patch, out: Path) -> Path:
    """Write ``out/`` with the patched weights, loadable by ``from_pretrained`` without ctxc.

    The patched weights are those :meth:`Patch.apply` writes (the weights the solver computed
    with, bit for bit), swapped in for the save by
    :func:`~ctxc.runs.patched_forward.patched_values`
    and out again: ``model`` is left as it was, and its own tensors (memory-mapped from its
    checkpoint) are never written or cloned. In memory, the one file ``save_pretrained`` would
    write (the same bytes for a model loaded from such a file: the header padded so that each
    patched weight sits where the solver read it) is written by two threads
    (:func:`write_shards`; the page-cache copy costs a core per 0.5 GB/s). A model opted in
    to :mod:`ctxc.store.frozen_shards` (the command line's) gets two shards instead: its
    unpatched weights hard-linked from one cache file, the patched ones written
    (:func:`write_split`). A model dispersed
    by accelerate is baked with :meth:`Patch.apply` (its store entries are pointed at the
    patched values) and saved shard by shard, each shard about one block, by
    :func:`write_shards`: no weight is gathered whole (``save_pretrained`` would read Gemma 3's
    670 MB embedding into memory), the unchanged ones are copied from their files in chunks.

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
    dispersed = is_dispersed(model)
    # Where the solver read each patched weight, before the patch points the store elsewhere:
    # the saved file puts them there again when reloaded (memory-mapped), as save_pretrained's
    # layout did for a model loaded from one.
    wanted = source_alignments(model, patch.deltas)
    # A dispersed model's store entries are pointed at the patched values (Patch.apply); in
    # memory, the values are only read by the save: where they sit does not matter.
    patched = (
        patched_values(model, patch, aligned=False)
        if not dispersed
        else patch.applied(model, check=False)
    )
    if tokenizer is not None:  # first: its files are read before the weights' write-back
        save_tokenizer(tokenizer, out)
    with patched:
        try:
            config.use_cache = True  # ctxc turns the cache off for export; users generate with it
            if not dispersed:
                # The unpatched weights linked from the cache (an opted-in model), or one
                # file, as save_pretrained writes it; by two writers (write_shards).
                linked = frozen_shards.enabled(model) and write_split(
                    model, out, patch.deltas, wanted
                )
                if linked or write_shards(model, out, _ONE_FILE, wanted, workers=2):
                    _save_config(model, out)
                else:
                    model.save_pretrained(str(out))
            elif write_shards(model, out, shard_kwargs(model)["max_shard_size"], wanted):
                _save_config(model, out)
            else:  # a checkpoint layout of its own (MoE experts): Transformers reverts it
                model.save_pretrained(str(out), **shard_kwargs(model))
                realign_shards(out, wanted)  # the addresses the solver computed at
        finally:
            config.use_cache = use_cache
    return out


def save_tokenizer(tokenizer, out: Path) -> None:
    """Write ``tokenizer`` into ``out``: its files copied, where it says it is unchanged.

    ``ctxc``'s command line loads a tokenizer from a folder and never changes it, and marks it
    with ``ctxc_files`` (that folder): copying the folder's tokenizer files gives the tokenizer
    as it was published and takes milliseconds, where ``save_pretrained`` re-serialises it
    (0.5 s for Gemma 3's 33 MB ``tokenizer.json``). Anything else is saved by Transformers.
    """
    import shutil

    names = _tokenizer_files(tokenizer)
    if names is None:
        tokenizer.save_pretrained(str(out))
        return
    for name in names:
        shutil.copyfile(tokenizer.ctxc_files / name, out / name)


def _tokenizer_files(tokenizer) -> list[str] | None:
    """The files of a marked tokenizer's folder that Transformers reads, or None to save it."""
    from transformers import tokenization_utils_base as tub

    source = getattr(tokenizer, "ctxc_files", None)
    if source is None or hasattr(tokenizer, "image_processor"):  # a processor: more files
        return None
    names = {
        tub.TOKENIZER_CONFIG_FILE,
        tub.SPECIAL_TOKENS_MAP_FILE,
        tub.ADDED_TOKENS_FILE,
        tub.FULL_TOKENIZER_FILE,
        tub.CHAT_TEMPLATE_FILE,
        "chat_template.json",  # the older name, still read
        *getattr(tokenizer, "vocab_files_names", {}).values(),
    }
    present = sorted(n for n in names if (Path(source) / n).is_file())
    return present if tub.TOKENIZER_CONFIG_FILE in present else None


_ONE_FILE = 1 << 62  # max_shard_size: never split


def _save_config(model, out: Path) -> None:
    """The files ``save_pretrained`` writes beside the weights (Transformers'
    ``PreTrainedModel.save_pretrained``: the dtype and architecture noted in the config)."""
    config = model.config
    config.dtype = str(model.dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(out))
    if model.can_generate():
        model.generation_config.save_pretrained(str(out))
