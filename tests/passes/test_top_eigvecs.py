"""The fit's rank-r bases (passes/solver/fit_moves.py): the subspace iteration against a full
``eigh``, where each is used, and the same vectors at every run."""

from __future__ import annotations

import pytest
import torch

from ctxc.passes.solver import fit_moves as fm


def _gram(m: int, decades: float, seed: int) -> torch.Tensor:
    """A PSD matrix [m, m] whose spectrum falls over ``decades`` (geometrically)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=torch.float64)).Q  # [m, m]
    evals = torch.logspace(0, -decades, m, dtype=torch.float64)  # [m]
    return (q * evals) @ q.T


def _captured(gram: torch.Tensor, vecs: torch.Tensor) -> float:
    return float(((gram @ vecs) * vecs).sum() / gram.trace())


@pytest.mark.parametrize("decades", [8.0, 12.0])
def test_subspace_captures_what_eigh_does(decades):
    gram = _gram(640, decades, 0)
    evals, vecs = fm._top_eigvecs(gram, 64)
    want_vals, want = torch.linalg.eigh(gram)
    want = want.flip(1)[:, :64]
    assert not torch.equal(vecs, want), "a steep spectrum took the full eigh: nothing saved"
    got, best = _captured(gram, vecs), _captured(gram, want)
    assert vecs.shape == (640, 64)
    assert torch.allclose(vecs.T @ vecs, torch.eye(64, dtype=torch.float64), atol=1e-10)
    assert best - got <= 2e-3 * best, f"captured {got:.6f} against eigh's {best:.6f}"
    assert got <= best + 1e-12, "a rank-64 basis captured more than the top 64 eigenvectors"
    assert torch.all(evals[:-1] >= evals[1:]), "eigenvalues not descending"
    top = float(want_vals.flip(0)[0])
    assert abs(float(evals[0]) - top) <= 1e-6 * top, f"top eigenvalue {evals[0]} vs {top}"


@pytest.mark.parametrize("decades", [1.0, 4.0])
def test_flat_spectrum_takes_the_full_eigh(decades):
    gram = _gram(640, decades, 0)  # the iteration falls 1e-2 to 7e-2 short here
    evals, vecs = fm._top_eigvecs(gram, 64)
    want_vals, want = torch.linalg.eigh(gram)
    assert torch.equal(evals, want_vals.flip(0)[:64]) and torch.equal(vecs, want.flip(1)[:, :64])


def test_zero_gram_gives_no_direction():
    basis = fm._top_right(torch.zeros(200, 640, dtype=torch.float64), 64)
    assert basis.shape == (640, 1) and float(basis.abs().sum()) == 1.0


def test_large_share_of_the_side_is_exact():
    gram = _gram(100, 4.0, 1)  # r + 16 = 66 > 100 / 2: eigh
    evals, vecs = fm._top_eigvecs(gram, 50)
    want_vals, want = torch.linalg.eigh(gram)
    assert torch.equal(evals, want_vals.flip(0)[:50]) and torch.equal(vecs, want.flip(1)[:, :50])


def test_same_vectors_every_run():
    gram = _gram(640, 4.0, 2)
    a, b = fm._top_eigvecs(gram, 64), fm._top_eigvecs(gram, 64)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "the iteration is not seeded"
