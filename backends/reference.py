"""Reference runs every emitter checks its artefact against (torch, on the CPU).

Shared by every backend folder, so that no format imports another's: the inputs an artefact is
checked at, the unpatched model fed context + query (what every fidelity is measured against),
and a model's logits for given inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from ctxc.frontend.trace import no_cache
from ctxc.models.offload import input_device
from ctxc.passes.runtime.plain_head import default_forward_rows
from ctxc.patch import Patch

__all__ = ["check_ids", "head_at_query_rows", "reference_logits", "torch_logits"]

# The second length an export is checked at (the exporter can fix a length silently).
_SECOND_LENGTH = 16


def check_ids(patch: Patch) -> list[torch.Tensor]:
    """The inputs an artefact is checked at: the query, and a longer tail of the full input.

    Returns:
        ``[query [1, k], tail [1, n]]`` int64, ``k < n <= max(k + 1, 16)`` (a context is never
        empty, so the tail is always longer than the query).
    """
    full = patch.meta.context_ids + patch.meta.query_ids
    k = len(patch.meta.query_ids)
    n = min(len(full), max(k + 1, _SECOND_LENGTH))
    return [torch.tensor([patch.meta.query_ids]), torch.tensor([full[-n:]])]


def reference_logits(model: torch.nn.Module, patch: Patch) -> torch.Tensor:
    """The unpatched model fed context + query: its logits at the query positions.

    Args:
        model: the model the patch was computed on, unpatched.
        patch: its context and query ids are used.

    Returns:
        float32 [k, vocab] on the CPU.
    """
    ids = torch.tensor([patch.meta.context_ids + patch.meta.query_ids])
    k = len(patch.meta.query_ids)
    with no_cache(model), head_at_query_rows(model, k):
        # a copy: a slice would keep all n rows alive (15 GB at 14k tokens, 262k vocabulary)
        return torch_logits(model, [ids])[0][-k:].clone()


@contextlib.contextmanager
def head_at_query_rows(model: torch.nn.Module, k: int) -> Iterator[bool]:
    """While open, ``model``'s LM head computes the last ``k`` rows alone, bit for bit as its
    default call over every row gives them (``default_forward_rows``, which checks the BLAS
    kernel's row blocking on a probe before it trusts a shorter call).

    The default forward applies the head to every position: at n tokens that is [n, vocab]
    float32 logits (3.7 GB at 3,500 tokens of Gemma 3's 262k vocabulary, 1.1 TFLOP) to read k
    rows; here it is [k, vocab]. The forward's later ops (a final soft cap) are element-wise and
    see the k rows. Only a plain ``nn.Linear`` head on the CPU with no hook of accelerate's is
    replaced; any other head runs as it is (the yield says which).

    Side effects: sets the head module's ``forward`` attribute and deletes it on exit.
    """
    get = getattr(model, "get_output_embeddings", None)
    found = get() if callable(get) else None
    if not (
        isinstance(found, torch.nn.Linear)
        and type(found) is torch.nn.Linear
        and found.weight.device.type == "cpu"
        and not hasattr(found, "_hf_hook")
        and "forward" not in vars(found)
    ):
        yield False
        return
    head: torch.nn.Linear = found

    def linear(x: torch.Tensor, weight: object, bias: object) -> torch.Tensor:
        assert isinstance(weight, torch.Tensor) and (bias is None or isinstance(bias, torch.Tensor))
        return F.linear(x, weight, bias)

    def forward(x: torch.Tensor) -> torch.Tensor:  # x [..., n, d] -> [..., k, vocab]
        return default_forward_rows(linear, x, head.weight, head.bias, min(k, x.shape[-2]))

    head.forward = forward  # type: ignore[method-assign,assignment]  # on the instance alone
    try:
        yield True
    finally:
        del head.forward


def torch_logits(model: torch.nn.Module, ids: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``model``'s logits for each input.

    Args:
        model: a causal LM.
        ids: int64 inputs, each [1, n].

    Returns:
        float32 [n, vocab] on the CPU, one per input.
    """
    device = input_device(model)  # a dispersed model's hooks move the rest
    with torch.no_grad():
        return [model(input_ids=x.to(device)).logits[0].float().cpu() for x in ids]
