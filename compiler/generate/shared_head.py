"""The reduced run's LM head on two threads, for ``ctxc generate`` (issue 11).

A step applies the LM head twice: the baseline's cached decode step gives the full context's
logits, the reduced run the patched model's. On a CPU each is a matrix-vector product bound by
memory: Gemma 3's head is 262,144 x 640 (670 MB in float32), about half of a decode step
(measured: 53 ms of 103 ms, 2 threads). One thread streams the weights about as fast as two
(the kernel's threads share one stream), but two threads reading different rows stream twice as
fast (measured: two 670 MB products on two threads at once, 55 ms; one after the other, 108 ms).

``ctxc generate`` runs the decode step, head included, on a worker thread while the solver
runs; when both are done, the reduced run's head node calls :func:`split_linear`: the first
rows of the weights on the calling thread, the others on the worker, each with half the torch
threads. Each output row is its dot product in the kernel's own order only if the kernel treats
those rows alike in the half as in the whole (measured on this machine's CPU: it does for blocks
of 512 rows, not for a block of 409), so the split falls on a multiple of :data:`_ROW_MULTIPLE`
rows and :func:`head_split` first checks it on the head's weights, bit for bit; where it
differs, the head runs whole as before.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from ctxc.frontend.trace import TracedModel
from ctxc.passes.locate.block_map import BlockMap
from ctxc.passes.locate.graph_view import GraphView

__all__ = ["head_split", "split_linear"]

_ROW_MULTIPLE = 512  # where the split may fall: the kernel's blocks of rows start alike there
_MIN_ROWS = 8 * _ROW_MULTIPLE  # below this, one thread's product is not worth splitting

aten = torch.ops.aten


def split_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, worker: ThreadPoolExecutor
) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, its rows split between this thread and ``worker``.

    Args:
        x: input [..., in]; weight: [out, in]; bias: [out] or None.
        worker: a one-thread executor with nothing else to do.

    Returns:
        [..., out]. Torch's thread count is halved for the two products and then restored.
    """
    cut = weight.shape[0] // 2 // _ROW_MULTIPLE * _ROW_MULTIPLE
    low = None if bias is None else bias[cut:]
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // 2))
    try:
        rest = worker.submit(_linear_no_grad, x, weight[cut:], low)
        try:
            first = F.linear(x, weight[:cut], None if bias is None else bias[:cut])
        finally:
            last = rest.result()  # waited for even when this side failed
    finally:
        torch.set_num_threads(threads)
    return torch.cat([first, last], dim=-1)


def _linear_no_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    with torch.no_grad():  # grad mode is per thread: the worker's is not the caller's
        return F.linear(x, weight, bias)


def head_split(
    traced: TracedModel, blocks: BlockMap, worker: ThreadPoolExecutor | None
) -> Callable[[Callable[[], object]], Callable] | None:
    """The reduced run's head node as :func:`split_linear`, when it gives the head's bits.

    Args:
        traced: the exported model; blocks: its block map (``head``: the LM head linear).
        worker: the executor the decode step runs on; None: nothing to split with.

    Returns:
        ``op_for(wait)`` -> the head node's op, which first calls ``wait()`` (the worker's
        decode step must be done); None when the head is not a CPU ``aten.linear`` or the
        split product differs, in any bit, from the whole one on a probe input.
    """
    if worker is None or blocks.head is None:
        return None
    node = GraphView.of(traced).by_name[blocks.head]
    places = traced.graph.find_nodes(op="placeholder")
    if node.target is not aten.linear.default or not all(a in places for a in node.args[1:]):
        return None
    values = traced.placeholder_values(torch.zeros(1, 1, dtype=torch.long))
    params = [values[places.index(a)] for a in node.args[1:]]  # the weight (and bias)
    tensors = [p for p in params if isinstance(p, torch.Tensor) and p.device.type == "cpu"]
    if len(tensors) != len(params):
        return None
    weight, bias = tensors[0], (tensors[1] if len(tensors) > 1 else None)
    if weight.shape[0] < _MIN_ROWS:
        return None
    g = torch.Generator().manual_seed(0)
    probe = torch.randn(1, 1, weight.shape[1], generator=g).to(weight.dtype)
    with torch.no_grad():
        split, whole = split_linear(probe, weight, bias, worker), F.linear(probe, weight, bias)
    if not torch.equal(split, whole):
        return None

    def op_for(wait: Callable[[], object]) -> Callable:
        def op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
            wait()  # the decode step, head included, is done: the worker is free
            return split_linear(x, w, b, worker)

        return op

    return op_for
