"""The full run of a compile and its reference: the model's own default forward, bit for bit.

Every figure of a compile is measured against what the user's runtime computes on context +
query: plain Transformers, the model's default attention, every position's logits (README,
"Which reference"). The full run over the traced graph gives those values at the query
positions: its blocks compute the forward's ops, its head is applied as the default forward
applies it (``passes/runtime/plain_head.py``), and its attention calls are the runtime's where the
runtime's attention differs from the graph's (``compiler/runs/plain_attention.py``).
"""

from __future__ import annotations

import torch

from ctxc.frontend.trace import TracedModel
from ctxc.passes.locate.block_map import BlockMap
from ctxc.passes.runtime.run_graph import FullRun, record_targets
from ctxc.runs.image_run import MultimodalRun
from ctxc.runs.plain_attention import PlainAttention, graph_ops, sdpa_calls

__all__ = ["full_run"]


def full_run(
    model: torch.nn.Module,
    traced: TracedModel,
    blocks: BlockMap,
    full_ids: torch.Tensor,
    k: int,
    image_run: MultimodalRun | None,
    attention: PlainAttention,
) -> tuple[FullRun, torch.Tensor]:
    """The full run's targets, and the reference logits at the query positions [k, vocab]: the
    model's own default forward on context + query (images included), bit for bit.

    The graph's full run gives them (its head as the default forward applies it,
    ``passes/runtime/plain_head.py``), unless the runtime's attention differs from the graph's
    (``attention.follow``): then the graph takes the runtime's attention calls from the model's
    own forward, whose logits are the reference. For an image context the reference is the
    model's own multimodal forward, which ``image_run`` ran already.

    Args:
        model: the model, unpatched.
        traced, blocks: the full run's graph and block map.
        full_ids: int64 [1, n], context + query (for an image context, its token ids).
        k: the query's length.
        image_run: the image context's multimodal run, or None.
        attention: the runtime's attention on the query (:func:`plain_attention`).

    Returns:
        (the :class:`FullRun`, the reference [k, vocab] float32).
    """
    ops, plain = {}, None
    if attention.follow:
        if image_run is None:
            logits, calls = sdpa_calls(model, full_ids)  # [n, vocab]
            plain = logits[-k:]
        else:
            calls = image_run.attention
        ops = graph_ops(traced, calls)
    source = full_ids if image_run is None else image_run.inputs_embeds
    full = record_targets(traced, blocks, source, k, reference=True, ops=ops)
    if image_run is not None:
        plain = image_run.reference
    reference = full.reference if plain is None else plain.to(full.logits.device)
    assert reference is not None
    return full, reference
