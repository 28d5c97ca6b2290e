"""The PEFT adapter's fidelity bound (issue 21). Torch-free.

The figures quoted are max |logit diff| on the bundled Gemma 3 270M (float32, logits up to ~35).
"""

from __future__ import annotations

__all__ = ["PEFT_RTOL"]

# PEFT: the adapter loaded with PeftModel.from_pretrained and merged holds the baked weights
# bit for bit, at the addresses the solver read them modulo 64 (backends/peft/write.py): it
# must match the torch patched model as two runs of one model do. Relative to the largest logit
# (1e-5 of ~35 is 3.5e-4); as loaded (W x + B (A x), not exact) is reported, not bounded.
PEFT_RTOL = 1e-5
