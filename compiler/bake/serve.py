"""``ctxc.bake.serve``: a thought patch a serving engine's LoRA loader takes (issue 36).

vLLM and llama.cpp load LoRA pairs of linear weights, one rank for every module, and refuse
norm weights and ``modules_to_save``: a servable bake moves no norm scale (a model without post
norms never does; on one with them, ``--linear-only``; ``--method additive`` is linear by
construction; ``--method distill`` from scratch trains LoRA pairs alone) at an integer rank,
every delta padded to it with zero columns (they change nothing). ``--emit lora`` is for vLLM,
whose ``--max-lora-rank`` takes a few ranks only. Which kinds hold linear weights only
(:attr:`Backend.rules <ctxc.backends.base.Backend.rules>`) and which ranks they load
(:attr:`Backend.ranks <ctxc.backends.base.Backend.ranks>`) are the backends' declarations,
read here; the artefacts themselves are written and checked by the backends ``ctxc compile
--emit`` uses (:func:`~ctxc.backends.emit_checked`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ctxc.backends import backend
from ctxc.core.errors import OptionError
from ctxc.core.options import BakeOptions
from ctxc.core.vocabulary import ADDITIVE_METHOD, DISTILL_METHOD

if TYPE_CHECKING:  # torch-free at import: check_servable runs before the model loads
    from ctxc.passes.locate.block_map import BlockMap
    from ctxc.patch import Patch

__all__ = ["check_servable", "check_servable_blocks", "pad_to_rank", "servable_kinds"]


def check_servable(kinds: list[str], options: BakeOptions, rank: str) -> None:
    """Refuse, before the model loads, a LoRA artefact the bake's options cannot give (whether
    the fit moves norm scales is the model's: :func:`check_servable_blocks`, once it loads).

    Args:
        kinds: the ``--emit`` kinds.
        options: the bake's options.
        rank: the ``--rank`` text (``full`` and ``auto`` give matrices of several ranks).

    Raises:
        OptionError: one line naming the parameters: a rank that is not one number, or a
            rank the kind's engine does not load (``lora``: vLLM's).
    """
    asked = servable_kinds(kinds)
    if not asked:
        return
    kind = asked[0]
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


def servable_kinds(kinds: Sequence[str]) -> list[str]:
    """The kinds among ``kinds`` that hold linear LoRA pairs only (a serving engine's)."""
    return [k for k in kinds if backend(k).rules is not None]


def check_servable_blocks(kinds: Sequence[str], options: BakeOptions, blocks: BlockMap) -> None:
    """Refuse, once the model's blocks are located and before the fit, a LoRA artefact of a
    fit that moves norm scales: a block whose output is set through its post norm (Gemma's
    sandwich norms), or an attention output behind one that the fit moves. A model without
    post norms (Llama, Qwen, SmolLM2) is fitted by linear moves alone, ``--linear-only`` or not.

    Args:
        kinds: the ``--emit`` kinds.
        options: the bake's options.
        blocks: the located blocks (:func:`~ctxc.store.traced.traced_blocks`).

    Raises:
        OptionError: one line naming the first such block and the parameter to give.
    """
    asked = servable_kinds(kinds)
    if not asked or options.linear_only or options.method == ADDITIVE_METHOD:
        return
    if options.method == DISTILL_METHOD and not options.distill_from_fit:
        return  # a LoRA on linears alone (ctxc.bake.distill); from the fit it keeps its moves
    for b in blocks.blocks:
        if b.output_control != "linear":
            why = f"{b.path}'s output goes through its post norm's {b.output_control}"
        elif options.moves_attention and b.attention is not None:
            why = f"{b.path}'s attention output goes through a post norm"
        else:
            continue
        raise OptionError(
            "{emit} {} holds linear weights only, and this bake moves norm scales ({}): bake "
            "with {method} distill (a LoRA trained on the fit data) or {linear_only}",
            asked[0],
            why,
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
