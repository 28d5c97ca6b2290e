"""A patch as serving engines' LoRA pairs: linear weight deltas of one rank, nothing else.

Shared by the formats that hold such pairs (``lora/`` for vLLM, ``lora.gguf`` for llama.cpp), so
that neither imports the other; ``ctxc export`` refuses a patch from it before the model loads.
"""

from __future__ import annotations

import torch

from ctxc.core.errors import CtxcError
from ctxc.patch import Delta, Patch

__all__ = ["refuse_unservable", "servable_deltas"]


def refuse_unservable(patch: Patch, what: str) -> None:
    """Refuse a patch with a norm-scale, bias or expert-bank delta, from the patch alone (no
    model: ``ctxc export`` says so before the model loads).

    Raises:
        CtxcError: one line naming the first such parameter and the rule to use.
    """
    for name, delta in patch.deltas.items():
        if delta.vector is not None or delta.experts or not name.endswith(".weight"):
            kind = "an expert bank" if delta.experts else "a norm scale or bias"
            raise CtxcError(
                f"{what} holds linear weights only; this patch changes {name} ({kind}, from "
                f"--update {patch.meta.update}): compile with --update lora"
            )


def servable_deltas(model: torch.nn.Module, patch: Patch, what: str) -> dict[str, Delta]:
    """The patch's deltas by module, when every one is a serving engine's LoRA pair.

    Args:
        model: the model the patch applies to.
        patch: the patch.
        what: the artefact, for the message (``--emit lora``).

    Returns:
        module name -> its weight's delta (all of one rank).

    Raises:
        CtxcError: a norm scale, bias or expert-bank delta, a delta of a module that is not a
            ``nn.Linear``, or mixed ranks: one line that names the rule to use.
    """
    refuse_unservable(patch, what)
    found: dict[str, Delta] = {}
    for name, delta in patch.deltas.items():
        module = name.rpartition(".")[0]
        layer = model.get_submodule(module)
        if not isinstance(layer, torch.nn.Linear) or delta.layout != "out_in":
            raise CtxcError(f"{what} holds nn.Linear weights only; {name} is not one")
        found[module] = delta
    ranks = {d.rank for d in found.values()}
    if len(ranks) > 1:
        raise CtxcError(f"{what} needs one rank for every module; this patch has {sorted(ranks)}")
    if not found:
        raise CtxcError(f"{what}: the patch changes no weight")
    return found
