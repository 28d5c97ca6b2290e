"""Every fidelity bound ctxc checks an artefact against, in one place (issue 21). Torch-free.

A check runs an artefact where it runs and compares it with a reference; each bound below says
what it compares, why it has its value, and what that was measured on. Where a runtime differs
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

__all__ = [
    "BAKE_TARGETS_RTOL",
    "EXACT_ATOL",
    "GGUF_ATOL",
    "LLAMA_CPP_FACTOR",
    "LLAMA_CPP_MIN_FLOOR",
    "LLAMA_CPP_PATCH_SHARE",
    "ONNX_ATOL",
    "ONNX_FLOOR_FACTOR",
    "PEFT_RTOL",
    "RELOAD_ATOL",
    "RELOAD_ULPS",
    "RUNTIME_SLACK",
    "floor_bound",
    "reload_bound",
]

# What "exact" means for a float32 patched model fed the query alone, against the model fed
# context + query: the coverage matrix's verdict and the bound on the bundled Gemma. The
# model's own float32 run is 1.7e-5 from its float64 run (context + query), the patched model's
# reduced pass 4e-6 from the full run, a reload into fresh tensors 1.4e-5 to 2.1e-5 (MATH.md 12).
EXACT_ATOL = 1e-5

# torch: the written model/ reloaded by plain from_pretrained, fed the query, against the full
# context, float32. Twice the largest distance the same weights at other addresses give
# (fresh tensors, MATH.md 12: 2.1e-5) plus the model's own float32 floor on a one-token run
# (5e-5): a patch that passes is as exact as the runtime can show; a wrong model is off by
# whole logits (a PaliGemma with the wrong attention mask: 3.41).
RELOAD_ATOL = 1e-4
# The same in a low-precision dtype: this many spacings of the dtype at the largest logit
# (bfloat16: the paper's 0.125 to 0.375 at logits 16 to 32 is one to three spacings).
RELOAD_ULPS = 4.0
_EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}

# ONNX (baked model.onnx, patchable model.onnx, ort-adapter): onnxruntime against the torch
# patched model, at the query and a 16-token tail. onnxruntime by itself, on the unpatched
# model, is 6.3e-5 to 6.9e-5 from torch on a one-token query and 1.6e-5 to 5e-5 on context +
# query (7.3e-4 at 1075 tokens: other summation orders, post-norm gains up to 1.66e3). The
# patched model's check measured 1.7e-5 to 3.8e-5 (benchmarks/fidelity/onnx.py --baked 13), at
# or under that floor: its rounding gain is at most 1 per block (MATH.md 12; before, up to
# 7.4e-4, and 1.1e-3 to 1.5e-3 on new texts, which refused the export). The absolute bound is
# what a baked export, which has no unpatched twin to measure, must meet: the largest floor seen
# (7.3e-4) with room. Where the floor is measured (the patchable graph run without its factors
# is the unpatched model) the bound is ONNX_FLOOR_FACTOR times it when that is larger: a model
# whose onnxruntime run is itself far from torch is not refused for it. Tiny random models
# measure 1e-7 to 7e-7.
ONNX_ATOL = 1e-3
ONNX_FLOOR_FACTOR = 4.0

# GGUF: the F32 file reloaded by Transformers' GGUF loader (the weights dequantised into fresh
# tensors), fed the query, against the torch patched model. The F32 file holds the patched
# weights exactly (norm scales through 1 + w and back: one rounding at most), so what is left is
# the fresh tensors' other kernel paths: 1.1e-5 to 2.5e-5 on the thirteen texts (1.57e-4 on a
# 344-token text before MATH.md 12, which refused the file), as the same weights in fresh
# tensors give in torch (1.1e-5 to 2.1e-5). F16 and BF16 files are reported, not bounded.
GGUF_ATOL = 1e-4

# PEFT: the adapter loaded with PeftModel.from_pretrained and merged holds the baked weights
# bit for bit, at the addresses the solver read them modulo 64 (backends/peft/write.py): it
# must match the torch patched model as two runs of one model do. Relative to the largest logit
# (1e-5 of ~35 is 3.5e-4); as loaded (W x + B (A x), not exact) is reported, not bounded.
PEFT_RTOL = 1e-5


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


def reload_bound(dtype: str, logit_scale: float) -> float:
    """The bound on a reloaded model's max |logit diff| from the full-context reference.

    Args:
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        logit_scale: the largest |logit| of the reference.

    Returns:
        :data:`RELOAD_ATOL` in float32; :data:`RELOAD_ULPS` spacings of the dtype at the
        largest logit otherwise (never below :data:`RELOAD_ATOL`).
    """
    if dtype == "float32":
        return RELOAD_ATOL
    eps = _EPS.get(dtype, _EPS["bfloat16"])
    return max(RELOAD_ATOL, RELOAD_ULPS * eps * max(1.0, abs(logit_scale)))


# What another runtime may add to the solver's own figure, relative to max(1, the largest
# |full-context logit|), by the arithmetic's dtype. float32: the worst measured on Gemma 3 270M
# is 7.4e-4 (ONNX, README Backends) against logits of about 30, i.e. 2.5e-5 relative; 1e-4
# leaves 4x. The half types: their rounding of weights alone moves logits by about a percent.
# The gate catches a wrong artefact (a patch value scaled by 1000 moves logits by 44); the
# per-artefact checks against the torch patched model measure precision.
RUNTIME_SLACK = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}


# The artefact in llama.cpp may be this many times llama.cpp's own floor from its full-context
# run: the floor is one runtime's departure from Transformers on the query alone; the patched
# model adds the same departure once more, on other activations (issue 21, check 2).
LLAMA_CPP_FACTOR = 2.0
# The floor is never taken below ctxc's own exactness bound (a reloaded model within 1e-5 of the
# full-context run): on a tiny model llama.cpp and Transformers agree to 3e-8, and a bound of
# 6e-8 would refuse artefacts exact by every other check.
LLAMA_CPP_MIN_FLOOR = 1e-5
# ... and within this share of the patch's own effect of ctxc's patched model (Transformers, the
# same query): a check against the full-context run alone is vacuous for a patch that is not
# exact (a baked one is tens of logits from it, and so is an adapter that changes nothing), so
# the served logits are also held to the patched model's. Measured on the bundled model, a
# linear-only bake: llama.cpp + lora.gguf 0.15-0.25 from the patched model, whose effect is 37-41
# (issue 36); an adapter that changes nothing is the whole effect away.
LLAMA_CPP_PATCH_SHARE = 0.05

# `ctxc bake`: the fit targets from one cached context run against the graph's own recording of
# the first query (compiler/bake/targets.py), relative max difference (rounding is ~1e-6 in fp32).
BAKE_TARGETS_RTOL = 1e-3
