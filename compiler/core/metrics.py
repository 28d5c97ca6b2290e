"""Fidelity figures: how close a model's next-token prediction is to the full-context model's."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

__all__ = ["Fidelity", "fidelity", "top1_word"]


@dataclass(frozen=True)
class Fidelity:
    """Agreement of logits with the full-context model's, over the query positions.

    Attributes:
        max_abs_logit_diff: ``max |l - l_full|`` over positions and vocabulary.
        mean_abs_logit_diff: mean of ``|l - l_full|``.
        total_variation: largest ``0.5 * sum |p - q|`` over positions.
        top1_match: True when the argmax agrees at every query position.
        top1: argmax token at the last position.
        top1_full: the full-context model's argmax at the last position.
    """

    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    total_variation: float
    top1_match: bool
    top1: int
    top1_full: int

    def to_dict(self) -> dict:
        return asdict(self)


def top1_word(match: bool, *, loud: bool = True) -> str:
    """How a summary line says whether the top-1 tokens agree: ``match`` or ``MISMATCH``.

    Args:
        match: the tokens agree (:attr:`Fidelity.top1_match`, or several such figures and-ed).
        loud: a mismatch in capitals, as every headline figure says it; False for a side figure
            (``mismatch``: the report's unpatched comparison, expected to miss).
    """
    if match:
        return "match"
    return "MISMATCH" if loud else "mismatch"


def fidelity(logits: torch.Tensor, full: torch.Tensor) -> Fidelity:
    """Compare ``logits`` with ``full``, both [k, vocab] (or [vocab]), in float64.

    Returns:
        the :class:`Fidelity` figures.
    """
    a = logits.detach().double().reshape(-1, logits.shape[-1])  # [k, vocab]
    b = full.detach().double().reshape(-1, full.shape[-1])  # [k, vocab]
    diff = (a - b).abs()
    tv = 0.5 * (a.softmax(-1) - b.softmax(-1)).abs().sum(-1)  # [k]
    top_a, top_b = a.argmax(-1), b.argmax(-1)  # [k]
    return Fidelity(
        max_abs_logit_diff=float(diff.max()),
        mean_abs_logit_diff=float(diff.mean()),
        total_variation=float(tv.max()),
        top1_match=bool((top_a == top_b).all()),
        top1=int(top_a[-1]),
        top1_full=int(top_b[-1]),
    )
