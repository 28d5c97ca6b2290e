"""The fidelity bounds every stage shares (issue 21). Torch-free.

A check runs an artefact where it runs and compares it with a reference; each bound says what it
compares, why it has its value, and what that was measured on. This module holds what is no one
backend's: what exact means, the gate's slack, the floor rule, bake's target check. Each
backend's own bounds live beside it, in a ``thresholds.py`` of its folder (``backends/onnx/``,
``backends/gguf/``, ``backends/peft/``), and the reload bound two formats share in
``backends/thresholds.py``: ``core`` names no backend, and every bound is still in a module of
that name (``tests/core/test_thresholds.py``). Where a runtime differs
from Transformers by itself (onnxruntime sums in other orders; weights reloaded at other
addresses take other CPU kernel paths), the bound is the larger of an absolute bound and a
multiple of that runtime's own distance from torch on the unpatched model at the same inputs,
measured in the same check (:func:`floor_bound`): a runtime that is itself far from torch on some
model does not fail every patch of it, and a patch that amplifies the runtime's rounding well
beyond the model's own does not pass. Patches amplify rounding no more than the model does
(MATH.md 12), which is what lets the factors be small.

The figures quoted are max |logit diff| on the bundled Gemma 3 270M (float32, logits up to ~35),
the thirteen texts of ``benchmarks/texts/`` and ``examples/``, unless said otherwise.
"""

from __future__ import annotations

import math

__all__ = ["BAKE_TARGETS_RTOL", "EXACT_ATOL", "RUNTIME_SLACK", "floor_bound"]

# What "exact" means for a float32 patched model fed the query alone, against the model fed
# context + query: the coverage matrix's verdict and the bound on the bundled Gemma. The
# model's own float32 run is 1.7e-5 from its float64 run (context + query), the patched model's
# reduced pass 4e-6 from the full run, a reload into fresh tensors 1.4e-5 to 2.1e-5 (MATH.md 12).
EXACT_ATOL = 1e-5


def floor_bound(absolute: float, floor: float | None, factor: float) -> float:
    """The bound a check applies: ``max(absolute, factor * floor)``.

    Args:
        absolute: the absolute bound (what holds when no floor was measured).
        floor: the runtime's own distance from torch on the unpatched model at the same inputs,
            measured in the same check; None (or NaN) when not measured.
        factor: how many times that floor a patched model may reach.

    Returns:
        the bound.
    """
    if floor is None or math.isnan(floor):
        return absolute
    return max(absolute, factor * floor)


# What another runtime may add to the solver's own figure, relative to max(1, the largest
# |full-context logit|), by the arithmetic's dtype. float32: the worst measured on Gemma 3 270M
# is 7.4e-4 (onnxruntime, README Backends) against logits of about 30, i.e. 2.5e-5 relative; 1e-4
# leaves 4x. The half types: their rounding of weights alone moves logits by about a percent.
# The gate catches a wrong artefact (a patch value scaled by 1000 moves logits by 44); the
# per-artefact checks against the torch patched model measure precision.
RUNTIME_SLACK = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}

# `ctxc bake`: the fit targets from one cached context run against the graph's own recording of
# the first query (compiler/bake/targets.py), relative max difference (rounding is ~1e-6 in fp32).
BAKE_TARGETS_RTOL = 1e-3
