"""Torch backend, checked: the model folder written, reloaded by plain Transformers, measured.

The registry's ``torch`` emitter (``backends/__init__.py``), as every other backend's: it
writes the folder, reloads it as a user would (``from_pretrained``, placed as the model was)
and feeds it the query alone; the emit loop then holds that figure to the patch's own solver
figure (``ctxc.core.checks.gate``). A patch without a solver figure to hold it to (a baked
thought patch) is held instead to the patched model in memory, within the reload bound
(``ctxc.backends.thresholds.reload_bound``): ``ctxc bake --emit torch`` is checked too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ctxc.backends.reference import reference_logits, torch_logits
from ctxc.backends.thresholds import reload_bound
from ctxc.backends.torch.model import emit_torch
from ctxc.core.checks import enforce, fidelity_limit
from ctxc.core.errors import CtxcError
from ctxc.core.metrics import Fidelity, fidelity, top1_word
from ctxc.core.report import reference_name
from ctxc.frontend.trace import trace
from ctxc.models.devices import block_device_map, placement_of
from ctxc.models.offload import input_device
from ctxc.passes.runtime.run_graph import run_logits
from ctxc.patch import Patch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["TorchFigures", "emit_torch_checked", "reload_fidelity", "reloaded_logits"]


@dataclass(frozen=True)
class TorchFigures:
    """The written model folder, reloaded and fed the query alone.

    Attributes:
        folder: the folder's name in the output (``model``), or ``""``: the output itself.
        reloaded: its fidelity to the full context (``reference``).
        reference: what ``reloaded`` is measured against, in words.
        measured_on: how it was reloaded (``model/ reloaded with AutoModelForCausalLM...``).
        vs_patched: max |logit diff| from the patched model in memory, when the patch has no
            solver figure to be held to; else None.
    """

    folder: str
    reloaded: Fidelity
    reference: str
    measured_on: str
    vs_patched: float | None = None

    def to_dict(self) -> dict:
        data: dict[str, object] = {
            "emitted": {**self.reloaded.to_dict(), "reference": self.reference},
            "emitted_measured_on": self.measured_on,
        }
        if self.vs_patched is not None:
            data["vs_patched"] = self.vs_patched
        return data

    def fidelities(self) -> dict[str, Fidelity]:
        """The folder reloaded, held to the patch's figure by the gate."""
        return {"reloaded": self.reloaded}

    def summary(self) -> str:
        name = f"{self.folder}/" if self.folder else "model folder"
        r = self.reloaded
        top = top1_word(r.top1_match)
        return (
            f"{name}, reloaded, fed the query alone: max |logit diff| "
            f"{r.max_abs_logit_diff:.3g}, top-1 {top}"
        )


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


def reload_fidelity(
    folder: Path, patch: Patch, dtype: str, full: torch.Tensor, like=None
) -> tuple[Fidelity, torch.Tensor]:
    """The written model folder, reloaded by plain Transformers and fed the query alone.

    Args:
        folder: the emitted model folder.
        patch: its query ids are fed.
        dtype: the model dtype name.
        full: the full-context logits at the query positions [k, vocab].
        like: the model it came from: the folder is reloaded placed as it was.

    Returns:
        the :class:`~ctxc.core.metrics.Fidelity` of the reloaded model against ``full``, and
        its logits [k, vocab] (float32, on ``full``'s device).

    Raises:
        CtxcError: the reloaded model gives non-finite logits.
    """
    logits = reloaded_logits(folder, patch.meta.query_ids, dtype, like)
    if not bool(logits.isfinite().all()):
        raise CtxcError("the written model gives non-finite logits: nothing was written")
    logits = logits.to(full.device)
    return fidelity(logits, full), logits


def emit_torch_checked(
    model: PreTrainedModel,
    patch: Patch,
    out: Path,
    full: torch.Tensor | None = None,
    tokenizer=None,
    folder: str = "model",
    baked: torch.Tensor | None = None,
) -> tuple[Path, TorchFigures]:
    """Write ``out/folder`` (``emit_torch``), reload it and measure it.

    Args:
        model: the model the patch was computed on (unpatched).
        patch: the patch to bake into the folder.
        out: the artefact's staging folder.
        full: the full-context logits at the query positions [k, vocab], if computed.
        tokenizer: saved beside the weights, when given.
        folder: the folder's name inside ``out``; ``""``: ``out`` itself (``ctxc export --to
            torch``: the output folder is the model).
        baked: ``model`` with the patch's weights fed the query [k, vocab], if computed (only
            read for a patch without a solver figure).

    Returns:
        the folder and its :class:`TorchFigures`.

    Raises:
        CtxcError: non-finite logits; CheckFailed: (a patch without a solver figure) the
            reloaded folder beyond the reload bound from the patched model in memory.
    """
    from ctxc.models.vlm import auto_model_class

    target = out / folder if folder else out
    emit_torch(model, tokenizer, patch, target)
    if full is None:
        full = reference_logits(model, patch)
    reloaded, logits = reload_fidelity(target, patch, patch.meta.dtype, full, model)
    vs_patched = None
    if fidelity_limit(patch.meta, full) is None:  # nothing to hold it to but the patch itself
        vs_patched = _vs_patched(model, patch, logits, baked, folder)
    shown = f"{folder}/" if folder else "the folder"
    return target, TorchFigures(
        folder=folder,
        reloaded=reloaded,
        reference=reference_name(model),
        measured_on=f"{shown} reloaded with {auto_model_class(model.config).__name__}"
        ".from_pretrained",
        vs_patched=vs_patched,
    )


def _vs_patched(model, patch: Patch, logits: torch.Tensor, baked, folder: str) -> float:
    """The reloaded logits' max |diff| from the patched model in memory, within the bound."""
    from ctxc.models.offload import input_device
    from ctxc.runs.patched_forward import patched_logits

    if baked is None:
        query = torch.tensor([patch.meta.query_ids], device=input_device(model))
        baked = patched_logits(model, patch, query)
    baked = baked.float().to(logits.device)
    diff = float((logits - baked).abs().max())
    enforce(
        f"{folder}/" if folder else "model folder",
        "max |logit diff| from the patched model in memory",
        diff,
        reload_bound(patch.meta.dtype, float(baked.abs().max())),
    )
    return diff
