"""The buffer pool and the patched values computed into its buffers (quick: no model)."""

from __future__ import annotations

import pytest
import torch

from ctxc.core.buffer_pool import BufferPool
from ctxc.core.delta_math import add_in_float32, aligned_empty_like, at_alignment_of, lowrank_dense
from ctxc.patch import Delta
from tests.fixtures.helpers import diff_msg


def _offset(base: torch.Tensor, elements: int) -> torch.Tensor:
    """``base``'s values at an address ``elements`` past a fresh allocation's (mod 64 bytes)."""
    buf = torch.empty(base.numel() + elements, dtype=base.dtype)
    out = buf[elements:].view(base.shape)
    return out.copy_(base)


def test_take_gives_the_alignment_and_reuses_what_was_given_back() -> None:
    pool = BufferPool()
    base = _offset(torch.randn(64, 48), 3)  # 12 bytes past a 64-byte boundary
    a = pool.take(base)
    assert a.shape == base.shape and a.dtype == base.dtype and a.is_contiguous()
    assert a.data_ptr() % 64 == base.data_ptr() % 64, (a.data_ptr() % 64, base.data_ptr() % 64)
    b = pool.take(base)
    assert b.data_ptr() != a.data_ptr()  # a is still lent
    pool.give(a)
    assert pool.take(base) is a  # given back: lent again, no new buffer
    other = _offset(torch.randn(64, 48), 5)
    assert pool.take(other).data_ptr() % 64 == other.data_ptr() % 64  # another key
    pool.reclaim()
    assert {id(pool.take(base)) for _ in range(2)} == {id(a), id(b)}


def test_take_new_is_a_fresh_allocations_twin() -> None:
    pool = BufferPool()
    t = pool.take_new((32, 16), torch.float32, "cpu")
    fresh = torch.empty(32, 16)
    assert t.shape == (32, 16) and t.data_ptr() % 64 == fresh.data_ptr() % 64
    pool.give(t)
    assert pool.take_new((32, 16), torch.float32, "cpu") is t


@pytest.mark.parametrize("rank", [1, 3, 16])
@pytest.mark.parametrize("layout", ["out_in", "in_out"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_materialize_into_the_pool_is_bit_for_bit(rank: int, layout: str, dtype) -> None:
    """The value computed into the pool's buffers (and the dense delta into its temporary) is
    the value ``at_alignment_of(materialize(base), base)`` gives, at the same alignment."""
    g = torch.Generator().manual_seed(rank)
    out, inn = 96, 80
    u, v = torch.randn(out, rank, generator=g), torch.randn(inn, rank, generator=g)
    shape = (out, inn) if layout == "out_in" else (inn, out)
    base = _offset(torch.randn(*shape, generator=g).to(dtype), 7)
    delta = Delta("w", "b", u=u, v=v, layout=layout)
    want = at_alignment_of(delta.materialize(base), base)
    pool = BufferPool()
    for _ in range(2):  # twice: the second time into buffers given back
        got = delta.materialize(base, pool=pool)
        assert got.data_ptr() % 64 == base.data_ptr() % 64
        assert torch.equal(got, want), diff_msg(f"{layout} r={rank} {dtype}", got, want)
        aligned = delta.materialize(base, aligned=True)
        assert torch.equal(aligned, want) and aligned.data_ptr() % 64 == base.data_ptr() % 64
        pool.reclaim()
    plain = add_in_float32(base, lowrank_dense(u, v, layout))
    into = add_in_float32(base, lowrank_dense(u, v, layout), out=aligned_empty_like(base))
    assert torch.equal(plain, into), diff_msg("add_in_float32 out=", into, plain)


def test_a_vector_delta_into_the_pool() -> None:
    base = _offset(torch.randn(40), 1)
    delta = Delta("norm.weight", "b", vector=torch.randn(40))
    got = delta.materialize(base, pool=BufferPool())
    assert torch.equal(got, delta.materialize(base)) and got.data_ptr() % 64 == base.data_ptr() % 64


def test_an_expert_bank_delta_into_the_pool() -> None:
    """A bank's delta (two of four experts) computed into the pool is the buffer taken, with
    the bits ``at_alignment_of(materialize(base))`` gives."""
    g = torch.Generator().manual_seed(4)
    base = _offset(torch.randn(4, 24, 16, generator=g), 2)  # [E, out, in]
    u, v = torch.randn(2, 24, 1, generator=g), torch.randn(2, 16, 1, generator=g)
    delta = Delta("experts.w", "b", u=u, v=v, experts=(1, 3))
    want = at_alignment_of(delta.materialize(base), base)
    pool = BufferPool()
    got = delta.materialize(base, pool=pool)
    assert torch.equal(got, want), diff_msg("bank", got, want)
    pool.give(got)
    assert pool.take(base) is got  # the value returned is the pool's own buffer
