"""Busy processes beside a measurement: the machine under contention, for the cost benchmarks.

``compile`` runs N one-thread loops of float32 products beside it (``--load N``); ``bake`` one
pure-Python loop (``--loaded``). Each loop is its own process, killed and reaped when the
``with`` body ends, so its CPU time never counts in the next measurement.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["PRODUCTS", "PYTHON_LOOP", "busy"]

# One thread of 1024 x 1024 float32 products, without end (a BLAS-bound neighbour).
PRODUCTS = (
    "import torch\n"
    "torch.set_num_threads(1)\n"
    "a = torch.randn(1024, 1024)\n"
    "while True:\n"
    "    a = torch.tanh(a @ a)\n"
)
PYTHON_LOOP = "while True: pass"  # an interpreter-bound neighbour


@contextlib.contextmanager
def busy(n: int, loop: str = PRODUCTS) -> Iterator[None]:
    """``n`` processes running ``loop`` for the ``with`` body (none for 0)."""
    procs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()  # reaped here: its CPU time must not count in the next measurement
