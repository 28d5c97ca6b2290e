"""A decode loop's output projection in bfloat16, with the tokens near the top recomputed exactly.

A bake writes its fit data by decoding (self-study questions and answers, samples): each step
reads the whole output projection for a handful of rows, and Gemma 3's 262,144 x 640 head in
float32 is 670 MB a step, more than half of the bake's decode time on a CPU (py-spy, issue 55).
Read in bfloat16 it takes 32 ms a step of 16 rows instead of 140 ms (2 threads, AVX512-BF16).

Every token whose bfloat16 logit lies within a margin of its row's largest is recomputed in
float32 from the head's own weights; the margin is :data:`MARGIN` or twice the row's rounding
bound, ``||x|| max_v ||w_v|| 2^-7``, whichever is larger, so the greedy pick is the float32
head's argmax (up to the last bits of a float32 product of another shape, as between two
thread counts): the greedy loops (self-study answers, on-policy answers) use it always. The
tail keeps its bfloat16 value, so a sampled token is drawn from a distribution within total
variation 1e-3 of the float32 head's (at most, over 46 positions of Gemma 3 on three texts;
4.3e-4 at a margin of 10, 2.3e-5 at 15) but is not the same draw: the inverse-CDF sampler
(:func:`ctxc.bake.data.sample_tokens`) walks the vocabulary in id order, a shift of the tail
moves every later boundary, and about 3% of draws differ, as with another seed. The sampling
loops use it only where asked (``BakeOptions.sample_head``): a default bake's fit data 12.9 s
instead of 19.7 s (three interleaved pairs), greedy answers alone 19.5 s against 21.2 s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeGuard

import torch
import torch.nn.functional as F

__all__ = ["MARGIN", "shortlist_head"]

MARGIN = 8.0  # logits; the tail past it holds at most 1e-3 of the mass (Gemma 3)
_MIN_VOCAB = 32_768  # below this the head is cheap: left alone
_MAX_EXACT = 16_384  # more shortlisted tokens than this: the whole head in float32


@contextlib.contextmanager
def shortlist_head(model: torch.nn.Module) -> Iterator[bool]:
    """Within the block, the model's output projection runs as the module docstring says.

    Only a bias-free ``nn.Linear`` head in float32 on the CPU with at least 32,768 outputs is
    changed (elsewhere bfloat16 saves nothing or the weights are already narrower); anything else
    is left as it is. Side effects: sets the head's ``forward`` and a bfloat16 copy of its weight
    (half its size) for the block's duration; both are removed on exit, errors included.

    Yields:
        whether this block changed the head (not inside another such block).
    """
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not _eligible(head):
        yield False
        return
    if "forward" in vars(head):  # inside another such block (or another's forward): theirs
        yield False
        return
    weight = head.weight  # [vocab, d]
    narrow = weight.detach().to(torch.bfloat16)  # [vocab, d]
    widest = float(weight.detach().norm(dim=1).max())  # max_v ||w_v||

    def forward(x: torch.Tensor) -> torch.Tensor:
        return shortlisted_logits(x, weight, narrow, widest)

    head.forward = forward  # type: ignore[method-assign,assignment]  # on the instance alone
    try:
        yield True
    finally:
        del head.forward


def shortlisted_logits(
    x: torch.Tensor, weight: torch.Tensor, narrow: torch.Tensor, widest: float
) -> torch.Tensor:
    """``x @ weight.T`` with every row's tokens near its top exact and the rest in bfloat16.

    Args:
        x: hidden states [..., d], float32.
        weight: the head [vocab, d], float32.
        narrow: the head in bfloat16 [vocab, d].
        widest: the largest row norm of ``weight``.

    Returns:
        logits [..., vocab], float32.
    """
    flat = x.reshape(-1, x.shape[-1])  # [n, d]
    logits = F.linear(flat.to(torch.bfloat16), narrow).float()  # [n, vocab]
    # Rounding x and w to bfloat16 (8 bits) moves each product by at most 2^-8 of |x_i w_i|
    # twice over: |error| <= sum_i |x_i w_i| 2^-7 <= ||x|| ||w|| 2^-7 (Cauchy-Schwarz).
    bound = flat.norm(dim=-1, keepdim=True) * (widest * 2.0**-7)  # [n, 1]
    top = logits.amax(-1, keepdim=True)  # [n, 1]
    near = (logits >= top - torch.clamp(2 * bound, min=MARGIN)).any(0).nonzero()[:, 0]  # [k]
    if near.numel() > _MAX_EXACT:
        logits = F.linear(flat, weight)  # [n, vocab]
    else:
        logits[:, near] = F.linear(flat, weight[near])  # [n, k], float32
    return logits.reshape(*x.shape[:-1], weight.shape[0])


def _eligible(head: torch.nn.Module | None) -> TypeGuard[torch.nn.Linear]:
    return (
        type(head) is torch.nn.Linear
        and head.bias is None
        and head.weight.dtype == torch.float32
        and head.weight.device.type == "cpu"
        and head.weight.shape[0] >= _MIN_VOCAB
        and not hasattr(head, "_hf_hook")  # accelerate moves weights in and out per call
    )
