"""One read of the LM head's weights for both runs of a ``ctxc generate`` step (issue 11).

A step applies the LM head twice: the baseline's cached decode step gives the full context's
logits, the reduced run the patched model's. On a CPU both are matrix-vector products bound by
memory: Gemma 3's head is 262,144 x 640 (670 MB in float32), read whole each time, about half of
a decode step (measured: 53 ms of 103 ms, 2 threads). Here the decode runs with its head's input
trimmed to no rows (the head module's forward pre-hook keeps the input), and the reduced run's
head node calls :func:`dual_linear` with both inputs:

- with two or more torch threads, the two products run at once, one on a worker thread, each
  with half the threads: they stream the same weights together, and the pair costs what one
  product costs (measured 54.5 ms for both, against 110 ms one after the other);
- with one thread, the weights are applied a block of rows at a time, both inputs per block, so
  each block is read from memory once and a second time from the cache (77 ms for both).

Either gives each output row's dot product in the kernel's own order only if the kernel splits
and orders the work the same way (measured on this machine's CPU: one thread or two give the
same bits, and so do blocks of 512 rows, but blocks of 409 rows do not). So blocks are multiples
of :data:`_ROW_MULTIPLE` rows and :func:`head_share` first checks the model: a cached decode step
of a short probe, its logits compared bit for bit with :func:`dual_linear` on the head's input.
Where they differ, or the head is not a plain linear whose output is the graph's, or the weights
are not on the CPU, the step applies the head twice as before.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import fx

from ctxc.passes.block_map import BlockMap
from ctxc.passes.graph_view import GraphView
from ctxc.trace import TracedModel

__all__ = ["HeadShare", "dual_linear", "head_share"]

_BLOCK_BYTES = 5 << 19  # 2.5 MiB of weights per block: it stays in the cache for the second input
_ROW_MULTIPLE = 512  # blocks of rows start where the whole product's kernel blocks start


def dual_linear(
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    worker: ThreadPoolExecutor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(x, W, b), F.linear(y, W, b))``, reading ``W`` from memory once.

    Args:
        x, y: inputs [..., in] (one position each in ``ctxc generate``).
        weight: [out, in]; bias: [out] or None.
        worker: a one-thread executor: the products run at once, each with half of torch's
            threads (restored after); None: block of rows by block of rows.

    Returns:
        the two outputs [..., out].
    """
    if worker is not None:
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, threads // 2))
        try:
            theirs = worker.submit(_linear_no_grad, y, weight, bias)
            try:
                mine = F.linear(x, weight, bias)
            finally:
                other = theirs.result()  # waited for even when this side failed
        finally:
            torch.set_num_threads(threads)
        return mine, other
    row_bytes = weight.shape[1] * weight.element_size()
    rows = max(_ROW_MULTIPLE, _BLOCK_BYTES // row_bytes // _ROW_MULTIPLE * _ROW_MULTIPLE)
    xs, ys = [], []
    for start in range(0, weight.shape[0], rows):
        w = weight[start : start + rows]  # [rows, in], a view
        b = None if bias is None else bias[start : start + rows]
        xs.append(F.linear(x, w, b))
        ys.append(F.linear(y, w, b))
    return torch.cat(xs, dim=-1), torch.cat(ys, dim=-1)


def _linear_no_grad(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    with torch.no_grad():  # grad mode is per thread: the worker's is not the caller's
        return F.linear(x, weight, bias)


class HeadShare:
    """A forward pre-hook on the head module: keeps its input; when ``trim``, hands the module
    no rows, so the decode step reads none of its weights (the logits come from
    :meth:`head_op`). ``close`` removes the hook."""

    def __init__(self, module: torch.nn.Linear, worker: ThreadPoolExecutor | None) -> None:
        self.module = module
        self.worker = worker  # for the second product (:func:`dual_linear`); not owned
        self.trim = False
        self.hidden: torch.Tensor | None = None
        self.full: torch.Tensor | None = None
        self.handle = module.register_forward_pre_hook(self._pre)

    def _pre(self, module, args):
        self.hidden = args[0]  # [1, n, d]
        return (args[0][..., :0, :], *args[1:]) if self.trim else None

    def head_op(self, wait: Callable[[], object] | None = None) -> Callable:
        """The reduced run's head node: both heads at once; the baseline's logits in ``full``.
        ``wait()`` returns once the decode step has called the head (it runs on a worker)."""

        def op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
            if wait is not None:
                wait()
            assert self.hidden is not None
            hidden = self.hidden[..., -1:, :]  # [1, 1, d]
            mine, self.full = dual_linear(x, hidden, weight, bias, self.worker)
            return mine

        return op

    def close(self) -> None:
        self.handle.remove()


def _plain_head(traced: TracedModel, blocks: BlockMap) -> bool:
    """Is the graph's output the head linear's (no op after it, such as a soft cap)?"""
    if blocks.head is None or not blocks.head_module:
        return False
    view = GraphView.of(traced)
    out = next(n for n in reversed(view.nodes) if n.op == "output")
    first = out.args[0]
    node = first[0] if isinstance(first, tuple | list) and len(first) == 1 else first
    return isinstance(node, fx.Node) and node.name == blocks.head


def head_share(
    model: torch.nn.Module,
    traced: TracedModel,
    blocks: BlockMap,
    probe: torch.Tensor,
    cache_arg: str,
    cache_of: Callable,
    worker: ThreadPoolExecutor | None,
) -> HeadShare | None:
    """A :class:`HeadShare` on ``model``'s head when a cached decode step of ``probe`` (int64
    [1, n >= 2]) gives bit for bit the logits :func:`dual_linear` computes from the head's
    input (with ``worker``: both products at once, :func:`dual_linear`); None (nothing left
    registered) when it does not or cannot."""
    if not _plain_head(traced, blocks) or probe.shape[1] < 2:
        return None
    module = model.get_submodule(blocks.head_module or "")
    if type(module) is not torch.nn.Linear or module.weight.device.type != "cpu":
        return None
    share = HeadShare(module, worker)
    try:
        with torch.no_grad():
            cache = cache_of(model(input_ids=probe[:, :-1], use_cache=True))
            share.hidden = None
            logits = model(input_ids=probe[:, -1:], **{cache_arg: cache}, use_cache=True).logits
            hidden = share.hidden
            if hidden is None or hidden.shape[-2] != 1:
                share.close()
                return None
            mine, again = dual_linear(hidden, hidden, module.weight, module.bias, share.worker)
        if torch.equal(mine, logits) and torch.equal(again, logits):
            return share
    except Exception:
        share.close()
        raise
    share.close()
    return None
