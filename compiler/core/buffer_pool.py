"""Buffers for patched weights whose lifetimes follow one another, reused instead of reallocated.

The solver bakes each block's patched weights (a few MB each on Gemma 3 270M) and drops them
once the block is done; the verification swaps each module's patched weights in while it runs.
Each of those values was a fresh allocation of a large buffer, and glibc gives such buffers back
to the kernel when they are freed (``munmap``, or trimming the heap's top): the next one is
page-faulted in again, zeroed by the kernel page by page. Measured on Gemma 3 270M in a
compile after a forward pass: 25,000-97,000 minor faults in the solve, which took 0.29-0.41 s
against 0.20 s without them (``benchmarks/cost/compile.py``, docs/results/speed.md). A
:class:`BufferPool` hands a buffer back out once its value is no longer used, so a compile
touches one block's worth of new pages, not every patched weight's.
"""

from __future__ import annotations

import torch

from ctxc.core.delta_math import aligned_empty_like

__all__ = ["BufferPool"]


class BufferPool:
    """Uninitialised tensors for values computed again and again, reused once given back.

    :meth:`take` gives a buffer for a value computed like ``base`` (shape, dtype, device and
    address modulo 64 bytes: ``at_alignment_of``); :meth:`take_new` one as ``torch.empty``
    allocates it, for an op's ``out`` (a temporary). :meth:`give` or :meth:`reclaim` makes
    buffers available again; the caller vouches that nothing reads a buffer's value after
    giving it back. Mutates only itself.
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._taken: list[tuple[tuple, torch.Tensor]] = []

    def take(self, base: torch.Tensor) -> torch.Tensor:
        """A buffer of ``base``'s shape and dtype at its alignment (its contents undefined)."""
        key = (tuple(base.shape), base.dtype, base.device, base.data_ptr() % 64)
        return self._lend(key, lambda: aligned_empty_like(base))

    def take_new(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A buffer as ``torch.empty(shape, dtype=dtype, device=device)`` allocates it."""
        key = (tuple(shape), dtype, torch.device(device), "new")
        return self._lend(key, lambda: torch.empty(shape, dtype=dtype, device=device))

    def _lend(self, key: tuple, make) -> torch.Tensor:
        free = self._free.get(key)
        buf = free.pop() if free else make()
        self._taken.append((key, buf))
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """Make ``buf`` (from :meth:`take` or :meth:`take_new`) available again."""
        for i, (key, held) in enumerate(self._taken):
            if held is buf:
                del self._taken[i]
                self._free.setdefault(key, []).append(buf)
                return

    def reclaim(self) -> None:
        """Make every buffer taken so far available again."""
        for key, buf in self._taken:
            self._free.setdefault(key, []).append(buf)
        self._taken.clear()
