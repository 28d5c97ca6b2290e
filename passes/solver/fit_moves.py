"""The exact moves (MATH.md 1, 4) generalised from one query position to N: least squares.

A thought patch (issue 13; MATH.md 7, Mazzawi et al. 2025) is one patch for many positions. At
N positions a move cannot hit every target, so each becomes a ridge-regularised least-squares fit
with a rank budget: ``min ||X dW^T - Y||^2 + lam ||dW||^2``, ``rank(dW) <= R``, solved as a
reduced-rank ridge regression (the ridge solution projected on the top-R right singular vectors
of its fitted values ``X dW^T``: the best rank-R fit in the data's own metric, better than a
truncated SVD of ``dW``). With one position, ``lam = 0`` and ``R >= 1`` it is the exact move:
``dW = y x^T / ||x||^2``. Pure float32/float64 functions; rows are positions.

A fit may take a prior ``M`` [in, in] for its ridge: ``lam tr(dW M dW^T)`` instead of
``lam ||dW||^2``. With ``M`` the second moment of the linear's inputs on text unrelated to the
context, the ridge charges a move by what it changes there, ``E_k ||dW k||^2`` (the covariance
term of MEMIT, Meng et al. 2023, "Mass-Editing Memory in a Transformer", eq. 14): the patch
is held to leave the rest alone where the inputs of the rest lie (issue 53).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ctxc.core.options import block_slice
from ctxc.passes.solver.primitive_moves import SCALE_FLOOR, ConditionError, stable_post_norm_target

_NEWTON_STEPS = 60  # safeguarded Newton on F^(-1/2), nearly linear: converges in ~10

__all__ = [
    "FitOptions",
    "LsFit",
    "LsInput",
    "ScaleFit",
    "fit_bias",
    "fit_linear",
    "fit_scale",
    "residual_from_sums",
    "stable_targets",
]


@dataclass(frozen=True)
class FitOptions:
    """How a block's moves are fitted over N positions.

    Attributes:
        ridge: relative ridge strength: ``lam = ridge * ||X||_F^2 / in`` (the mean eigenvalue
            of ``X^T X``), so one value serves every layer whatever its activation scale;
            0: plain (minimum-norm) least squares, the exact move when it can be exact.
        rank: the rank budget per matrix; None: no budget (at most ``min(N, in, out)``).
        scale_ridge: the same for the post-norm scale, relative to ``mean_j f_ji^2``.
        input_moves: fit the inner linears' input moves; False: only the output move (outer
            linear and post-norm scale, or bias) carries the patch.
        rank_per_block: each block's matrices at that block's measured effective rank (the
            participation ratio of its per-position exact moves, rounded up), at most ``rank``.
        attention_moves: fit the attention output projection and its post-norm scale too,
            where a block has that surface (sandwich norms: Gemma 2/3, OLMo 2), so the residual
            after the attention reaches the full run's before the MLP's moves.
        linear_only: move linear weights only: no post-norm scale (the output move is the
            outer linear's), and a block whose output is set by a norm bias is refused.
        moved_blocks: which blocks move, a Python slice over their indices in graph order
            (``"9:"``: the tenth on, ``":9"``: the first nine); the others are run, not moved,
            and the blocks after them fit what is left. ``""``: every block.
    """

    ridge: float = 0.0
    rank: int | None = None
    scale_ridge: float = 0.0
    input_moves: bool = True
    rank_per_block: bool = False
    attention_moves: bool = False
    linear_only: bool = False
    moved_blocks: str = ""

    def moved(self, n: int) -> range:
        """The indices of the moved blocks among ``n`` (:attr:`moved_blocks`).

        Raises:
            ValueError: a spec that is not ``start:stop`` of integers.
        """
        return range(n)[block_slice(self.moved_blocks)]


@dataclass(frozen=True)
class LsFit:
    """A fitted matrix delta ``dW = u v^T`` and how well it fits.

    Attributes:
        u: [out, r] float32.
        v: [in, r] float32.
        rel_residual: ``||X dW^T - Y|| / ||Y||`` (0 for an exact fit; 1: nothing fitted).
    """

    u: torch.Tensor
    v: torch.Tensor
    rel_residual: float


class LsInput:
    """A fit's input rows in float64 and what every fit over them shares.

    The gate and up projections of a gated MLP read the same input ``z``: their two fits share
    its Gram (``X^T X`` or ``X X^T``) and the R of its QR, each computed once on first use
    (at a SmolLM2 default bake's ~2,300 positions about a fifth of the two fits' time).

    Args:
        x: the input at N positions [N, in].
    """

    def __init__(self, x: torch.Tensor):
        self.x = x.double()  # [N, in]
        self.energy = float(self.x.pow(2).sum())
        self._gram: torch.Tensor | None = None
        self._primal: torch.Tensor | None = None
        self._r: torch.Tensor | None = None

    def gram(self, primal: bool = False) -> torch.Tensor:
        """``X^T X`` [in, in] when N > in (or ``primal``), else the kernel ``X X^T`` [N, N]."""
        n, d_in = self.x.shape
        if primal and n <= d_in:  # the kernel's side is N: the primal Gram is another matrix
            if self._primal is None:
                self._primal = self.x.T @ self.x
            return self._primal
        if self._gram is None:
            self._gram = self.x.T @ self.x if n > d_in else self.x @ self.x.T
        return self._gram

    def r(self) -> torch.Tensor:
        """The R of ``X = Q R`` [in, in] (N > in)."""
        if self._r is None:
            self._r = torch.linalg.qr(self.x, mode="r").R
        return self._r


def fit_linear(
    x: torch.Tensor | LsInput,
    y: torch.Tensor,
    opts: FitOptions,
    what: str,
    prior: torch.Tensor | None = None,
) -> LsFit:
    """Reduced-rank ridge regression ``x dW^T ~ y``.

    Args:
        x: the linear's input at N positions [N, in], or its :class:`LsInput` (shared with
            another fit over the same rows).
        y: the wanted change of its output [N, out].
        opts: ridge and rank.
        what: the input's name, for the error message.
        prior: the ridge's metric ``M`` [in, in], symmetric positive definite with trace
            ``in`` (so ``opts.ridge`` means what it does without one): the penalty is
            ``lam tr(dW M dW^T)`` (module docstring). None: the identity.

    Returns:
        the :class:`LsFit`.

    Raises:
        ConditionError: ``x`` is zero (nothing can be moved through it).
    """
    inp = x if isinstance(x, LsInput) else LsInput(x)
    xd, yd = inp.x, y.double()  # [N, in], [N, out]
    n, d_in = xd.shape
    if inp.energy == 0.0:
        raise ConditionError(f"{what} is zero at all {n} positions: the move divides by ||{what}||")
    lam = opts.ridge * inp.energy / d_in
    full = min(n, d_in, y.shape[1])
    r = full if opts.rank is None else min(opts.rank, full)
    if n <= d_in and prior is None:  # kernel form: dW^T = X^T (X X^T + lam I)^+ Y, min-norm at 0
        c = _psd_solve(inp.gram(), yd, lam)  # [N, out]
        b = xd.T @ c  # [in, out]
        fitted = xd @ b  # [N, out]
        # Top-r right singular vectors of the fitted values, from their Gram [out, out] or [N, N].
        basis = _top_right(fitted, r)  # [out, r]
    else:
        # (X^T X + lam M) b = X^T Y; with a prior the primal form at any N (the kernel form's
        # identity would become M^-1 there).
        gram = inp.gram(primal=True)  # [in, in]
        cross = xd.T @ yd  # [in, out]
        b = _psd_solve(gram, cross, lam, None if prior is None else prior.double())  # [in, out]
        if y.shape[1] > d_in:
            # X = Q R, so X b = Q (R b) has the right singular vectors of R b [in, out]: a Gram
            # of side `in` instead of `out` (Gemma's gate/up: 640 instead of 2048; eigh is the
            # fit's cost at thousands of positions).
            basis = _top_right(inp.r() @ b, r)  # [out, r]
            u, v = basis, b @ basis  # [out, r], [in, r]
            # The residual from the sums, not from the fitted values [N, out] (a product of
            # N x in x out, as large as the solve's): ||X v u^T - Y||^2 =
            # ||X v||^2 - 2 <X^T Y, v u^T> + ||Y||^2, float64 (rounding ~1e-16 of ||Y||^2).
            return LsFit(u.float().contiguous(), v.float().contiguous(), residual_from_sums(
                gram, cross, u, v, float(yd.pow(2).sum())))  # fmt: skip
        fitted = xd @ b  # [N, out]
        basis = _top_right(fitted, r)  # [out, r]
    u, v = basis, b @ basis  # [out, r], [in, r]
    got = fitted @ basis @ basis.T  # [N, out]
    ynorm = float(yd.norm())
    rel = float((got - yd).norm()) / ynorm if ynorm > 0 else 0.0
    return LsFit(u.float().contiguous(), v.float().contiguous(), rel)


def residual_from_sums(
    gram: torch.Tensor, cross: torch.Tensor, u: torch.Tensor, v: torch.Tensor, energy: float
) -> float:
    """``||X v u^T - Y|| / ||Y||`` from ``X^T X`` [in, in], ``X^T Y`` [in, out], ``u``
    [out, r] (orthonormal columns), ``v`` [in, r] and ``||Y||^2`` (a fit from its sums alone:
    :func:`fit_linear`'s wide outputs, ``ctxc.bake.statistics.solve_site``)."""
    if energy <= 0.0:
        return 0.0
    fitted = float((gram @ v * v).sum())  # ||X v u^T||^2 = tr(v^T X^T X v): u^T u = I
    inner = float((cross @ u * v).sum())  # <X v u^T, Y> = tr(u^T Y^T X v)
    return max(fitted - 2.0 * inner + energy, 0.0) ** 0.5 / energy**0.5


def _psd_solve(
    a: torch.Tensor, b: torch.Tensor, lam: float, m: torch.Tensor | None = None
) -> torch.Tensor:
    """``(a + lam M)^+ b`` for a symmetric PSD ``a`` and ``M`` (the identity when ``m`` is
    None; a pseudo-inverse where singular at lam 0)."""
    shifted = a + lam * (torch.eye(a.shape[0], dtype=a.dtype) if m is None else m)
    if lam > 0:
        # Positive definite: Cholesky is BLAS3 and several times faster than eigh at side 2048.
        chol, info = torch.linalg.cholesky_ex(shifted)
        if int(info) == 0:
            return torch.cholesky_solve(b, chol)
    evals, evecs = torch.linalg.eigh(shifted)
    # Eigenvalues below rounding of the largest are the null space: drop them (minimum norm).
    keep = evals > evals.max().clamp_min(0) * a.shape[0] * torch.finfo(a.dtype).eps
    inv = torch.where(keep, 1.0 / torch.where(keep, evals, torch.ones_like(evals)), 0.0)
    return evecs @ (inv[:, None] * (evecs.T @ b))


def _top_right(f: torch.Tensor, r: int) -> torch.Tensor:
    """The top-``r`` right singular vectors of ``f`` [N, out], as [out, r] float64."""
    n, d = f.shape
    if n < d:  # through the left vectors: f^T (f f^T)-eigenvectors / sigma
        evals, evecs = torch.linalg.eigh(f @ f.T)  # ascending
        evals, evecs = evals.flip(0)[:r], evecs.flip(1)[:, :r]
        sig = evals.clamp_min(0).sqrt()
        ok = sig > sig.max() * 1e-12 if sig.numel() else sig > 0
        basis = (f.T @ evecs[:, ok]) / sig[ok]  # [out, r']
    else:
        evals, evecs = torch.linalg.eigh(f.T @ f)
        evals, basis = evals.flip(0)[:r], evecs.flip(1)[:, :r]
        basis = basis[:, evals > evals.max().clamp_min(0) * 1e-24]
    if basis.shape[1] == 0:  # nothing to fit: a zero delta of rank 1 keeps the file valid
        basis = torch.zeros(d, 1, dtype=f.dtype)
        basis[0, 0] = 1.0
    return basis


def stable_targets(s: torch.Tensor, t: torch.Tensor, u_now: torch.Tensor) -> torch.Tensor:
    """Each position's outer-linear output ``u*_j`` nearest its target through the scale
    (MATH.md 4, the stable rule per position), all rows at once.

    The secular equation of :func:`~ctxc.passes.solver.rms_inversion.nearest_unit_rms` is solved for
    every row together by safeguarded Newton; a row that does not converge (a near-hard case)
    and a single row (so one position gives the exact rule's bits) take the scalar solver.

    Args:
        s: the effective scale [d].
        t: the values the scaled product must take [N, d].
        u_now: the outer linear's output reached [N, d].

    Returns:
        ``u*`` [N, d], float32.
    """
    if t.shape[0] == 1:
        return stable_post_norm_target(s, t[0], u_now[0])[None]
    sd = s.double()
    sign = torch.where(sd < 0, -torch.ones_like(sd), torch.ones_like(sd))
    s_fit = sign * sd.abs().clamp_min(SCALE_FLOOR)  # [d]
    s2 = s_fit * s_fit  # [d]
    st = s_fit * t.double()  # [N, d]
    st2 = st * st  # [N, d]
    m = float(s2.min())
    lo = m - st2.sum(1).sqrt() / math.sqrt(s2.numel())  # [N]
    hi = torch.full_like(lo, m)  # [N]
    mu = lo.clone()  # [N]
    for _ in range(_NEWTON_STEPS):
        q = s2 - mu[:, None]  # [N, d], > 0 inside the bracket
        f = (st2 / q**2).mean(1)  # [N]
        if bool(((f - 1.0).abs() <= 1e-14).all()):
            break
        above = f > 1.0
        hi = torch.where(above, mu, hi)
        lo = torch.where(above, lo, mu)
        df = (2.0 * st2 / q**3).mean(1)  # [N]
        step = (f.rsqrt() - 1.0) / (-0.5 * f.pow(-1.5) * df)
        new = mu - step
        bad = ~((new > lo) & (new < hi)) | ~torch.isfinite(new)
        mu = torch.where(bad, 0.5 * (lo + hi), new)
    f = (st2 / (s2 - mu[:, None]) ** 2).mean(1)  # [N]
    w = st / (s2 - mu[:, None])  # [N, d]
    w = w / w.pow(2).mean(1, keepdim=True).sqrt()  # unit RMS
    rms = u_now.double().pow(2).mean(1, keepdim=True).sqrt()  # [N, 1]
    out = (rms * w).float()  # [N, d]
    for j in torch.nonzero(~((f - 1.0).abs() <= 1e-9) | ~torch.isfinite(w).all(1)).flatten():
        out[j] = stable_post_norm_target(s, t[j], u_now[j])
    return out


@dataclass(frozen=True)
class ScaleFit:
    """A fitted scale change over N positions.

    Attributes:
        ds: change of the effective scale [d], float32.
        max_change: largest ``|ds_i|``.
        max_gain: largest ``|s_i + ds_i|``.
        rel_residual: ``||t - s' f|| / ||t - s f||`` over the positions.
    """

    ds: torch.Tensor
    max_change: float
    max_gain: float
    rel_residual: float


def fit_scale(s: torch.Tensor, f: torch.Tensor, t: torch.Tensor, ridge: float) -> ScaleFit:
    """The scale change ``ds`` with ``(s + ds) * f_j ~ t_j`` over N positions, ridge to ``s``.

    Per coordinate: ``s'_i = (sum_j f_ji t_ji + lam_i s_i) / (sum_j f_ji^2 + lam_i)``, with
    ``lam_i = ridge * mean_i(sum_j f_ji^2)``; for one position and ridge 0 the exact ``t / f``.

    Args:
        s: the effective scale [d].
        f: the normalised MLP outputs reached [N, d].
        t: the wanted products [N, d].
        ridge: relative ridge (0: plain least squares).

    Raises:
        ConditionError: a coordinate with ``f = 0`` everywhere that must move, or non-finite ds.
    """
    s, f, t = s.double(), f.double(), t.double()  # [d], [N, d], [N, d]
    den = f.pow(2).sum(dim=0)  # [d]
    lam = ridge * float(den.mean())
    zero = (den + lam) == 0
    miss = (t - s * f).abs().amax(dim=0)  # [d]
    if bool((zero & (miss > 0)).any()):
        i = int(torch.nonzero(zero & (miss > 0))[0])
        raise ConditionError(
            f"normalised MLP output is 0 at every fit position at coordinate {i} (needed "
            f"change {float(miss[i]):.3g}): the scale cannot reach it"
        )
    new = (f * t).sum(0) + lam * s  # [d]
    new = torch.where(zero, s, new / torch.where(zero, torch.ones_like(den), den + lam))
    ds = new - s  # [d]
    if not bool(torch.isfinite(ds).all()):
        raise ConditionError("scale change is not finite (|f| underflows)")
    rest = t - s * f
    rel = float((t - new * f).norm() / rest.norm()) if float(rest.norm()) > 0 else 0.0
    return ScaleFit(ds.float(), float(ds.abs().max()), float(new.abs().max()), rel)


def fit_bias(d: torch.Tensor, root: torch.Tensor | None = None) -> torch.Tensor:
    """The bias change [out] adding ``d_j`` [N, out] at every position in the least-squares
    sense: their mean (exact for one position); with ``root`` [N] (each row's already
    multiplied by its ``sqrt(w_j)``), the weighted mean ``sum_j w_j d_j / sum_j w_j``."""
    if root is None:
        return d.double().mean(dim=0).float()
    r = root.double()
    return ((r[:, None] * d.double()).sum(dim=0) / r.pow(2).sum()).float()
