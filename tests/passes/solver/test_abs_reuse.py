"""``reused_abs_weights`` (passes/solver/output_magnitude.py, issue 33): inside it the rounding
figure's ``|W|`` is formed once per unchanged weight, the same bits as formed anew; a weight
written in place, a budget spent or the context left forms it again."""

from __future__ import annotations

import pytest
import torch

from ctxc.passes.solver import output_magnitude as om
from ctxc.passes.solver.output_magnitude import reused_abs_weights, summed_terms


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(300, 40, generator=g)
    return w, torch.randn(2, 40, generator=g), torch.randn(2, 300, generator=g)


def _counting(monkeypatch) -> list[int]:
    """Count the |W| formations (each a fresh ``float().abs()`` of a chunk)."""
    formed: list[int] = []
    real = om._abs_chunks

    def counted(w):
        before = om._KEPT.get()
        hit = before is not None and any(k[0] == w.data_ptr() for k in before.chunks)
        formed.append(0 if hit else 1)
        return real(w)

    monkeypatch.setattr(om, "_abs_chunks", counted)
    return formed


def test_kept_abs_gives_the_same_bits_and_is_formed_once(monkeypatch) -> None:
    w, h, u = _case()
    want = summed_terms(w, h, u)
    formed = _counting(monkeypatch)
    with reused_abs_weights():
        got = [summed_terms(w, h, u) for _ in range(3)]
        got.append(summed_terms(w.T.T, h, u))  # another view of the same weight
    for g in got:
        diff = (g - want).abs()
        assert torch.equal(g, want), f"max {diff.max():.3g}, mean {diff.mean():.3g}"
    assert formed == [1, 0, 0, 0], formed
    summed_terms(w, h, u)  # outside: nothing kept
    assert om._KEPT.get() is None


def test_a_weight_written_in_place_is_formed_again() -> None:
    w, h, u = _case(1)
    with reused_abs_weights():
        first = summed_terms(w, h, u)
        w.mul_(-2.0)  # its version moves on
        second = summed_terms(w, h, u)
    want = summed_terms(w, h, u)
    assert not torch.equal(first, second)
    diff = (second - want).abs()
    assert torch.equal(second, want), f"max {diff.max():.3g}, mean {diff.mean():.3g}"


@pytest.mark.parametrize("budget", [0, 300 * 40 * 4 - 1])
def test_past_the_budget_nothing_is_kept(budget: int) -> None:
    w, h, u = _case(2)
    with reused_abs_weights(budget):
        summed_terms(w, h, u)
        kept = om._KEPT.get()
        assert kept is not None and not kept.chunks and kept.room == budget
