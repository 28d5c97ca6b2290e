"""The MLP output nearest a post norm's target when the norm's scale stays fixed (``lora`` rule).

A serving engine's LoRA adapter holds linear weights only (vLLM rejects ``modules_to_save`` and
LoRA biases; llama.cpp's LoRA GGUF holds ``lora_a``/``lora_b`` pairs). Behind a scaled RMS post
norm ``y = v + s * u / rms(u)`` the down projection can give any direction ``u`` but the norm
then fixes its RMS: the branch reaches ``s * w`` with ``mean(w^2) = 1`` only (MATH.md 5). The
``lora`` rule moves ``u`` to the reachable point nearest the target ``t`` (MATH.md 4's problem
with the true scale, not a floored one: the scale does not move) and leaves the rest, which
the blocks above absorb because their targets are the full run's outputs (MATH.md 3).
"""

from __future__ import annotations

import math

import torch

from ctxc.passes.solver.primitive_moves import ConditionError
from ctxc.passes.solver.rms_inversion import nearest_unit_rms

__all__ = ["reachable_outputs"]


def reachable_outputs(s: torch.Tensor, t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per position, the outer-linear output ``u*`` with ``s * u*/rms(u*)`` nearest ``t``.

    Coordinates where ``s_i = 0`` are invisible in the output: they take whatever RMS budget
    the others leave, so when ``sum_J (t/s)^2 <= d`` over the visible coordinates ``J`` the
    target is met exactly; otherwise ``w_J = c w'`` with ``c = sqrt(d / |J|)`` and ``w'`` the
    nearest unit-RMS vector for the scale ``c s_J`` (:func:`nearest_unit_rms`), ``w`` zero
    elsewhere. ``u* = rms(u) w`` keeps each position's magnitude (MATH.md 4).

    Args:
        s: the post norm's effective scale [d] (unchanged by the rule).
        t: wanted scaled products [k, d] (:func:`~ctxc.passes.solver.block_moves.control_target`).
        u: the outer linear's output reached [k, d].

    Returns:
        ``u*`` [k, d], float32.

    Raises:
        ConditionError: the scale is zero everywhere (nothing behind the norm reaches ``y``).
    """
    s64 = s.double().flatten()  # [d]
    live = s64 != 0
    d, n = s64.numel(), int(live.sum())
    if n == 0:
        raise ConditionError("the post-norm scale is 0 at every coordinate: nothing reaches y")
    rows = []
    for t_j, u_j in zip(t.double(), u.double(), strict=True):
        w = torch.zeros(d, dtype=torch.float64)  # [d]
        exact = t_j[live] / s64[live]  # [n]
        budget = float(exact.pow(2).sum())
        if n < d and budget <= d:
            w[live] = exact  # the zero-scale coordinates carry the rest of the unit RMS
            w[~live] = math.sqrt((d - budget) / (d - n))
        else:
            c = math.sqrt(d / n)
            w[live] = c * nearest_unit_rms(c * s64[live], t_j[live]).w
        rows.append(u_j.pow(2).mean().sqrt() * w)  # [d]
    return torch.stack(rows).float()  # [k, d]
