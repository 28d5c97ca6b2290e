"""Reference runs every emitter checks its artefact against (torch, on the CPU)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ctxc.frontend.trace import no_cache, trace
from ctxc.models.devices import block_device_map, placement_of
from ctxc.models.offload import input_device
from ctxc.passes.runtime.run_graph import run_logits
from ctxc.patch import Patch

__all__ = ["check_ids", "reference_logits", "reloaded_logits", "torch_logits"]

# The second length an export is checked at (the exporter can fix a length silently).
_SECOND_LENGTH = 16


def check_ids(patch: Patch) -> list[torch.Tensor]:
    """The inputs an artefact is checked at: the query, and a longer tail of the full input.

    Returns:
        ``[query [1, k], tail [1, n]]`` int64, ``k < n <= max(k + 1, 16)`` (a context is never
        empty, so the tail is always longer than the query).
    """
    full = patch.meta.context_ids + patch.meta.query_ids
    k = len(patch.meta.query_ids)
    n = min(len(full), max(k + 1, _SECOND_LENGTH))
    return [torch.tensor([patch.meta.query_ids]), torch.tensor([full[-n:]])]


def reference_logits(model: torch.nn.Module, patch: Patch) -> torch.Tensor:
    """The unpatched model fed context + query: its logits at the query positions.

    Args:
        model: the model the patch was computed on, unpatched.
        patch: its context and query ids are used.

    Returns:
        float32 [k, vocab] on the CPU.
    """
    ids = torch.tensor([patch.meta.context_ids + patch.meta.query_ids])
    k = len(patch.meta.query_ids)
    with no_cache(model):
        return torch_logits(model, [ids])[0][-k:]


def torch_logits(model: torch.nn.Module, ids: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``model``'s logits for each input.

    Args:
        model: a causal LM.
        ids: int64 inputs, each [1, n].

    Returns:
        float32 [n, vocab] on the CPU, one per input.
    """
    device = input_device(model)  # a dispersed model's hooks move the rest
    with torch.no_grad():
        return [model(input_ids=x.to(device)).logits[0].float().cpu() for x in ids]


def reloaded_logits(
    folder: Path, query_ids: list[int], dtype: str, like: torch.nn.Module | None = None
) -> torch.Tensor:
    """A written model folder as a user loads it (plain ``from_pretrained``), fed the query.

    The report's ``emitted`` figures come from here: a model loaded from disk can take other
    kernel paths than the one patched in memory (see README, Backends), so only the reloaded
    folder measures what a user gets.

    Args:
        folder: a Transformers model folder.
        query_ids: the token ids to feed.
        dtype: ``float32`` | ``bfloat16`` | ``float16``.
        like: load it placed as this model was (its device, or accelerate's ``device_map`` and
            ``max_memory``: a dispersed model is never reloaded whole into memory).

    Returns:
        float32 [k, vocab] on the CPU.
    """
    from transformers import AutoConfig

    from ctxc.models.vlm import auto_model_class  # AutoModelForImageTextToText for a VLM

    auto = auto_model_class(AutoConfig.from_pretrained(str(folder)))
    placement = placement_of(like)
    kwargs = placement.load_kwargs()
    if placement.device_map is not None:  # reloaded dispersed, as it was compiled
        torch_dtype = getattr(torch, dtype)
        memory = kwargs.get("max_memory")
        kwargs["device_map"] = block_device_map(folder, torch_dtype, placement.device_map, memory)
        model = auto.from_pretrained(str(folder), dtype=torch_dtype, **kwargs)
        ids = torch.tensor([query_ids], device=input_device(model))
        k = len(query_ids)
        return run_logits(trace(model.eval(), k, (k, k), "static"), ids).cpu()
    model = auto.from_pretrained(str(folder), dtype=getattr(torch, dtype), **kwargs).eval()
    return torch_logits(model, [torch.tensor([query_ids])])[0]
