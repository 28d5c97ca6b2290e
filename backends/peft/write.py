"""The PEFT adapter's tensors, and the copies of a model PEFT builds and loads it on.

PEFT wraps the modules of the model it is given, and ``merge_and_unload()`` writes into the
weights of the LoRA targets; it writes no other base tensor (``lora_B`` starts at zero,
``modules_to_save`` copies its module). So the copies ctxc hands PEFT share the model's tensors
and own only the patched parameters: no copy of every weight (1 GB on Gemma 3 270M, twice per
adapter before issue 11). An owned parameter is copied at its original's address modulo 64
(``at_alignment_of``: CPU BLAS kernels round by alignment), so every kernel runs on the copy as
on the model itself, and the torch patched model's logits are those of the copy.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from ctxc.core.delta_math import at_alignment_of
from ctxc.patch import Delta, Patch

__all__ = ["bank_factors", "fill_adapter", "flags_kept", "shared_copy"]


def shared_copy(model: torch.nn.Module, own: Iterable[str] = ()) -> torch.nn.Module:
    """A copy of ``model``'s modules that shares its parameters and buffers.

    Args:
        model: the model.
        own: names of parameters the copy gets its own copy of, at the original's address
            modulo 64 (a parameter tied to others stays tied, to the copy).

    Returns:
        the copy. Side effect: none (``model`` is not changed; see :func:`flags_kept`).
    """
    memo: dict[int, object] = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    for name in own:
        param = model.get_parameter(name)
        value = at_alignment_of(param.detach(), param)
        memo[id(param)] = torch.nn.Parameter(value, requires_grad=param.requires_grad)
    return copy.deepcopy(model, memo)


@contextmanager
def flags_kept(model: torch.nn.Module) -> Iterator[None]:
    """Put back ``model``'s ``requires_grad`` flags when the body ends, however it ends.

    PEFT freezes the base parameters of the model it wraps; a :func:`shared_copy`'s are
    ``model``'s own.
    """
    shared = [*model.parameters(), *model.buffers()]
    flags = [t.requires_grad for t in shared]
    try:
        yield
    finally:
        for tensor, flag in zip(shared, flags, strict=True):
            tensor.requires_grad_(flag)


def fill_adapter(inner: torch.nn.Module, model: torch.nn.Module, patch: Patch, plan) -> None:
    """Write the patch's factors and whole-module values into PEFT's wrapped copy ``inner``.

    Args:
        inner: ``get_peft_model(...).base_model.model``.
        model: the model the patch was computed on (the whole modules' base values).
        patch: the patch.
        plan: its ``ctxc.backends.peft.adapter.AdapterPlan``.
    """
    with torch.no_grad():
        for module, delta in plan.lora.items():
            # PEFT's names: lora_A and lora_B are ModuleDicts of Linears, keyed by adapter.
            inner.get_parameter(f"{module}.lora_A.default.weight").copy_(delta.v.T)
            inner.get_parameter(f"{module}.lora_B.default.weight").copy_(delta.u)
        for name, wrapper in inner.named_modules():
            attr = getattr(wrapper, "parameter_name", None)
            if attr is None:
                continue
            # Parameter targets of one module nest: each wrapper's base_layer is the next.
            module = ".".join(p for p in name.split(".") if p != "base_layer")
            a, b = bank_factors(plan.banks[f"{module}.{attr}"], wrapper.num_experts)
            wrapper.get_parameter("lora_A.default.weight").copy_(a)
            wrapper.get_parameter("lora_B.default.weight").copy_(b)
        for module in plan.modules_to_save:
            saved = inner.get_submodule(f"{module}.modules_to_save.default")
            for name, delta in patch.deltas.items():
                owner, _, attr = name.rpartition(".")
                if owner == module:
                    getattr(saved, attr).copy_(delta.materialize(model.get_parameter(name)))


def bank_factors(delta: Delta, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's expert LoRA factors: ``lora_A`` [E r, in] rows (e, r), ``lora_B`` [out, r E]
    columns (r, e), zero for the experts the delta leaves alone."""
    assert delta.u is not None and delta.v is not None
    _, out_dim, rank = delta.u.shape
    index = list(delta.experts)
    a = delta.v.new_zeros(experts, rank, delta.v.shape[1])
    a[index] = delta.v.mT  # [n, r, in]
    b = delta.u.new_zeros(out_dim, rank, experts)
    b[:, :, index] = delta.u.permute(1, 2, 0)  # [out, r, n]
    return a.reshape(experts * rank, -1), b.reshape(out_dim, rank * experts)
