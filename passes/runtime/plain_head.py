"""The LM head at the query rows, bit for bit as the model's default forward computes it.

A plain Transformers forward applies the head to every position (``[n, d] @ W^T``, the default
``logits_to_keep=0``); the full run applies it to the query rows only (``[k, d] @ W^T``, as
``logits_to_keep=k`` and ``generate`` do), since Gemma 3's 262k-row head over 32k positions
would be 34 GB of logits. The sums are the same but a BLAS kernel rounds a row by how many rows
its call has: MKL on AVX-512 gives a call of fewer than 4 rows (fewer than 12 on two threads)
other kernels than a long one. On Gemma 3 270M that moves a one-token query's logits by
1.2e-5..3.2e-5 (13 texts, ``benchmarks/fidelity/fresh.py``): the runtime's own floor, which a
model fed the query alone cannot go under, and which a reference computed the full run's way
would hide.

:func:`default_forward_rows` gives the default forward's values for the last ``k`` rows without
the ``n``-row product: the head over the last ``m`` rows (``m`` = 16, 64 or 256, at least
``k``) gives the long call's bits when the kernel's row blocking is the same there. Whether it
is, is measured, not assumed: a probe of :data:`PROBE_COLUMNS` vocabulary rows is computed both
ways (``n`` rows and ``m`` rows) and compared bit for bit; the first ``m`` that agrees computes
the whole vocabulary, and when none does, all ``n`` rows are computed in slices of the
vocabulary. Splitting the vocabulary (the product's columns) into wide slices keeps each
logit's bits: every output element's sum runs over the same ``d`` terms in the same order
whatever the columns beside it (measured: 10,000- and 16,384-row slices of Gemma's head at
20..4,099 rows), but a slice of a few columns takes the kernel's narrow path (an 11-column
slice moved its logits by 2.9e-6), so no slice is narrower than :data:`_MIN_SLICE`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ctxc.models.placement import LazyWeight

__all__ = ["PROBE_COLUMNS", "default_forward_rows"]

# Vocabulary rows of the probe: wide enough that the kernel's choices (threads split the
# columns) are those of the whole head, cheap beside it (1.6% of Gemma 3's vocabulary).
PROBE_COLUMNS = 4096
# Row counts tried before the whole n rows: the kernels' small-call paths end below 16 rows on
# the machines measured; 64 and 256 leave room for more threads.
_ROWS = (16, 64, 256)
# Elements of one slice of the all-rows product (256 MiB of float32).
_SLICE_ELEMENTS = 1 << 26
# The narrowest slice: a call of a few columns takes other kernels (an 11-column last slice of a
# 12,299-row head changed its logits by 2.9e-6), so a narrower rest joins the slice before it.
_MIN_SLICE = 1024

Linear = Callable[[torch.Tensor, object, object], torch.Tensor]


def default_forward_rows(linear: Linear, x: torch.Tensor, weight, bias, k: int) -> torch.Tensor:
    """The head's output at the last ``k`` rows of ``x``, as one call over all its rows gives it.

    Args:
        linear: ``linear(x, weight, bias)``, the head's op as the run computes it (on the run's
            device; ``weight`` may be a :class:`LazyWeight`, ``bias`` None).
        x: the head's input [..., n, d], n >= k.
        weight: the head's weight [vocab, d] (a tensor or a :class:`LazyWeight`).
        bias: its bias [vocab] or None.
        k: the query rows.

    Returns:
        [..., k, vocab], bit for bit the last ``k`` rows of ``linear(x, weight, bias)``.
    """
    n, vocab = x.shape[-2], weight.shape[0]
    if n <= max(k, _ROWS[0]) or vocab <= PROBE_COLUMNS:  # the whole product costs little
        return linear(x, weight, bias)[..., -k:, :]
    probe_w, probe_b = _columns(weight, bias, 0, PROBE_COLUMNS)
    want = linear(x, probe_w, probe_b)[..., -k:, :]  # [..., k, probe]: the long call's bits
    for rows in sorted({max(k, r) for r in _ROWS if max(k, r) < n}):
        if torch.equal(linear(x[..., -rows:, :], probe_w, probe_b)[..., -k:, :], want):
            return linear(x[..., -rows:, :], weight, bias)[..., -k:, :]
    step = max(PROBE_COLUMNS, _SLICE_ELEMENTS // max(1, x.numel() // x.shape[-1]))
    starts = list(range(0, vocab, step))
    if len(starts) > 1 and vocab - starts[-1] < _MIN_SLICE:
        starts.pop()  # a narrow last slice would take the kernel's narrow path: join it
    out = []
    for start, stop in zip(starts, [*starts[1:], vocab], strict=True):
        w, b = _columns(weight, bias, start, stop)
        out.append(linear(x, w, b)[..., -k:, :])  # [..., k, slice]
    return torch.cat(out, dim=-1)


def _columns(weight, bias, start: int, stop: int) -> tuple[torch.Tensor, object]:
    """Rows ``start:stop`` of the head's weight (read from its store when offloaded) and bias."""
    w = weight.rows(start, stop) if isinstance(weight, LazyWeight) else weight[start:stop]
    if isinstance(bias, LazyWeight):
        bias = bias.get()
    return w, None if bias is None else bias[start:stop]
