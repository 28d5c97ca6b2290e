"""``BakeOptions.moved_blocks`` (library-only, issue 53): the fit moves a slice of the blocks;
the others are run, not moved, and the blocks after them fit what is left."""

from __future__ import annotations

import pytest
import torch

from ctxc.bake.data import FitData, special_prefix
from ctxc.bake.driver import BakeOptions, bake
from ctxc.core.errors import CtxcError
from testbed.tiny_models import shared, tiny_tokenizer
from tests.fixtures.helpers import random_ids


@pytest.mark.tiny
@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_only_the_moved_blocks_get_deltas_and_every_block_is_reported(family: str) -> None:
    """``"1:"`` leaves the first block's weights as they are and moves the rest (its figures
    still reported, with no move); ``""`` and ``":"`` are the plain bake; the same twice."""
    model, tok = shared(family), tiny_tokenizer()
    data = FitData([1, *random_ids(3, 20)], special_prefix(tok), [random_ids(4, 6)], ["file"])
    opts = BakeOptions(rank=4, attention=None)
    plain = bake(model, data=data, options=opts)
    every = bake(model, data=data, options=BakeOptions(**{**vars(opts), "moved_blocks": ":"}))
    later = bake(model, data=data, options=BakeOptions(**{**vars(opts), "moved_blocks": "1:"}))
    again = bake(model, data=data, options=BakeOptions(**{**vars(opts), "moved_blocks": "1:"}))
    first = plain.fit.blocks[0].path
    assert list(every.patch.deltas) == list(plain.patch.deltas)
    assert all(
        torch.equal(every.patch.deltas[n].dense(), d.dense()) for n, d in plain.patch.deltas.items()
    )
    moved = {d.block for d in later.patch.deltas.values()}
    assert first not in moved, sorted(moved)
    assert moved == {d.block for d in plain.patch.deltas.values()} - {first}, sorted(moved)
    assert [b.path for b in later.fit.blocks] == [b.path for b in plain.fit.blocks]
    assert later.fit.blocks[0].move_residuals == {} and later.fit.blocks[0].delta_norms == {}
    assert all(
        torch.equal(again.patch.deltas[n].dense(), d.dense()) for n, d in later.patch.deltas.items()
    )
    with pytest.raises(CtxcError, match="moved_blocks: 'x' is not start:stop"):
        BakeOptions(moved_blocks="x")
    with pytest.raises(CtxcError, match="moved_blocks picks the fit's blocks"):
        BakeOptions(moved_blocks="1:", method="additive")
