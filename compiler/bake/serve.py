"""``ctxc.bake.serve``: a thought patch a serving engine's LoRA loader takes (issue 36).

vLLM and llama.cpp load LoRA pairs of linear weights, one rank for every module, and refuse
norm weights and ``modules_to_save``: a servable bake is ``--linear-only`` (or ``--method
additive``, linear by construction) at an integer rank, every delta padded to it with zero
columns (they change nothing). ``--emit lora`` is for vLLM, whose ``--max-lora-rank`` takes
a few ranks only. Which kinds hold linear weights only (:attr:`Backend.rules
<ctxc.backends.base.Backend.rules>`) and which ranks they load (:attr:`Backend.ranks
<ctxc.backends.base.Backend.ranks>`) are the backends' declarations, read here; the artefacts
themselves are written and checked by the backends ``ctxc compile --emit`` uses
(:func:`~ctxc.backends.emit_checked`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ctxc.backends import backend
from ctxc.core.errors import OptionError
from ctxc.core.options import BakeOptions
from ctxc.core.vocabulary import ADDITIVE_METHOD, DISTILL_METHOD

if TYPE_CHECKING:  # torch-free at import: check_servable runs before the model loads
    from ctxc.patch import Patch

__all__ = ["check_servable", "pad_to_rank"]


def check_servable(kinds: list[str], options: BakeOptions, rank: str) -> None:
    """Refuse, before the model loads, a LoRA artefact the bake's patch cannot go into.

    Args:
        kinds: the ``--emit`` kinds.
        options: the bake's options.
        rank: the ``--rank`` text (``full`` and ``auto`` give matrices of several ranks).

    Raises:
        OptionError: one line naming the parameters: a fit that moves norm scales, a rank
            that is not one number, or a rank the kind's engine does not load (``lora``:
            vLLM's).
    """
    asked = [k for k in kinds if backend(k).rules is not None]  # linear weights only
    if not asked:
        return
    kind = asked[0]
    if options.method == DISTILL_METHOD:
        raise OptionError(
            "{emit} {} takes a fitted bake: {method} fit with {linear_only}, or {method} additive",
            kind,
        )
    if not (options.linear_only or options.method == ADDITIVE_METHOD):
        raise OptionError(
            "{emit} {} holds linear weights only, and this bake moves norm scales: bake with "
            "{linear_only} (or {method} additive)",
            kind,
        )
    if options.rank is None or options.rank_per_block:
        raise OptionError(
            "{emit} {} needs one rank for every module: give {rank} N, not {}", kind, rank
        )
    for name in asked:
        ranks = backend(name).ranks
        if ranks is not None and options.rank not in ranks:
            raise OptionError(
                "{emit} {} is for vLLM, whose max LoRA rank takes {}: {rank} {} is not one",
                name,
                ", ".join(map(str, ranks)),
                options.rank,
            )


def pad_to_rank(patch: Patch, rank: int) -> Patch:
    """``patch`` with every matrix delta of rank below ``rank`` padded to it by zero columns
    (the same weights; a serving LoRA has one rank for every module)."""
    import torch

    from ctxc.patch import Patch

    deltas = {}
    for name, d in patch.deltas.items():
        if d.u is not None and d.v is not None and d.u.shape[-1] < rank:
            pad = rank - d.u.shape[-1]
            u = torch.cat([d.u, d.u.new_zeros(*d.u.shape[:-1], pad)], -1)
            v = torch.cat([d.v, d.v.new_zeros(*d.v.shape[:-1], pad)], -1)
            d = dataclasses.replace(d, u=u, v=v)
        deltas[name] = d
    return Patch(deltas, patch.meta)
