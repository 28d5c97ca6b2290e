"""The fidelity bound two backend formats share: a model's weights reloaded, against the full
context (issue 21). Torch-free.

``model/`` reloaded by plain ``from_pretrained`` (``backends/torch/check.py``) and the dense
deltas added to the model (``backends/delta/deltas.py``) are the same patched weights in fresh
tensors, so they are held to one bound; it lives beside the formats, as what they share does
(pyproject's independence contract), not in either. The bounds every stage shares are in
``compiler/core/thresholds.py``; those of one format in its folder's ``thresholds.py``.
"""

from __future__ import annotations

__all__ = ["RELOAD_ATOL", "RELOAD_ULPS", "reload_bound"]

# The written model/ reloaded by plain from_pretrained, fed the query, against the full
# context, float32. Twice the largest distance the same weights at other addresses give
# (fresh tensors, MATH.md 12: 2.1e-5) plus the model's own float32 floor on a one-token run
# (5e-5): a patch that passes is as exact as the runtime can show; a wrong model is off by
# whole logits (a PaliGemma with the wrong attention mask: 3.41).
RELOAD_ATOL = 1e-4
# The same in a low-precision dtype: this many spacings of the dtype at the largest logit
# (bfloat16: the paper's 0.125 to 0.375 at logits 16 to 32 is one to three spacings).
RELOAD_ULPS = 4.0
_EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}


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
