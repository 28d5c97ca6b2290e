"""The model run with a patch's weights, one module's patched weights in memory at a time.

``Patch.apply`` writes every patched weight into the model and keeps a copy of each original to
restore it: for the verification of a compile that is a second copy of every MLP weight of the
model (a third of Gemma 3 270M, two thirds of a large model's weights), for one forward pass on
the query. :func:`patched_logits` instead lets each module that owns patched parameters read
them, while it runs, from tensors made when it starts and dropped when it ends; the model's own
tensors are never written. The values are those ``Patch.apply`` writes (:meth:`Delta.materialize`)
at the parameter's own address modulo 64 bytes (``at_alignment_of``: CPU BLAS kernels round by
alignment), so the logits are bit for bit those of the model with the patch applied
(``tests/pipeline/test_long_context.py``). :func:`patched_values` does the same for the
whole model at once, for writing its weights out (``ctxc.backends.torch.model.emit_torch``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ctxc.core.buffer_pool import BufferPool
from ctxc.patch import Patch

__all__ = ["patched_logits", "patched_values"]


def patched_logits(model: torch.nn.Module, patch: Patch, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [k, vocab] float32 of ``model`` fed ``input_ids`` [1, k] with ``patch``'s weights.

    Each owner module of a patched parameter gets a forward pre-hook that points the
    parameter at its patched value and a forward hook that points it back (``param.data``: the
    parameter object stays, its storage is swapped and restored, never written). When a
    parameter is read outside its owner's forward (its owner never ran, or it lives off the
    CPU memory, e.g. on the meta device under an offloading hook), the run falls back to
    ``patch.applied``. The model is left as it was, however the call ends.
    """
    owners: dict[str, list[str]] = {}
    for name in patch.deltas:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    params = {name: model.get_parameter(name) for name in patch.deltas}
    if any(p.device.type == "meta" for p in params.values()):
        return _applied_logits(model, patch, input_ids)
    fired: set[str] = set()
    handles, swaps = [], []
    pool = BufferPool()  # one module's patched weights are in use at a time
    try:
        for owner, names in owners.items():
            module = model.get_submodule(owner)
            swaps.append(swap := _swapper(patch, names, params, pool=pool))
            handles.append(module.register_forward_pre_hook(_pre(owner, swap, fired)))
            handles.append(module.register_forward_hook(lambda *_a, swap=swap: swap(False)))
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits[0].float()  # [k, vocab]
    finally:
        for handle in handles:
            handle.remove()
        for swap in swaps:  # a forward that raised may have left a module's weights swapped
            swap(False)
    if fired != set(owners):
        return _applied_logits(model, patch, input_ids)
    return logits


@contextmanager
def patched_values(
    model: torch.nn.Module, patch: Patch, aligned: bool = True
) -> Iterator[torch.nn.Module]:
    """``model`` with every patched parameter reading its patched value, for the ``with`` body.

    The values are those :meth:`Patch.apply` writes, at each parameter's address modulo 64
    (``aligned=False``: wherever they were computed, one copy fewer, for reading the values
    out rather than running the model), but the model's own tensors are never written: each
    parameter's storage is swapped (``param.data``) and swapped back at the end, kept by
    reference, so the restore is exact.
    Unlike ``Patch.applied`` it keeps no clone of the originals and writes nothing into a
    parameter memory-mapped from its checkpoint (no copy-on-write of every patched page).
    A model with parameters off the CPU memory (on the meta device under an offloading hook)
    falls back to ``patch.applied``. Side effect: none once the body ends, however it ends.
    """
    params = {name: model.get_parameter(name) for name in patch.deltas}
    if any(p.device.type == "meta" for p in params.values()):
        with patch.applied(model, check=False):
            yield model
        return
    swap = _swapper(patch, list(params), params, aligned)
    try:
        swap(True)
        yield model
    finally:
        swap(False)


def _pre(owner: str, swap: Callable[[bool], None], fired: set[str]) -> Callable:
    def hook(*_args) -> None:
        fired.add(owner)
        swap(True)

    return hook


def _swapper(
    patch: Patch,
    names: list[str],
    params: dict[str, torch.nn.Parameter],
    aligned: bool = True,
    pool: BufferPool | None = None,
) -> Callable[[bool], None]:
    """``swap(True)``: the owner's parameters read their patched values; ``swap(False)``: their
    own tensors again (kept by reference, so restoring is exact).

    With ``pool`` (aligned values), each value is computed into a buffer taken from it and
    given back when swapped out: the module's forward holds no reference to its weights once
    it returns (no autograd), so the next module's values reuse the pages.
    """
    own = {name: params[name].data for name in names}
    lent: dict[str, torch.Tensor] = {}  # name -> the pool's buffer it reads now

    def swap(patched: bool) -> None:
        for name in names:
            base = own[name]
            if patched:
                lend = pool if aligned else None
                value = patch.deltas[name].materialize(base, aligned, lend)
                params[name].data = value
                if lend is not None:
                    lent[name] = value
            else:
                params[name].data = base
                if pool is not None and name in lent:
                    pool.give(lent.pop(name))

    return swap


def _applied_logits(model: torch.nn.Module, patch: Patch, ids: torch.Tensor) -> torch.Tensor:
    with patch.applied(model, check=False), torch.no_grad():
        return model(input_ids=ids).logits[0].float()  # [k, vocab]
