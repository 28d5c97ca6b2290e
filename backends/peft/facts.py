"""What the PEFT declaration and the PEFT emitters both read, torch-free.

A module of the folder does not import the folder's ``__init__.py``: the declaration there
imports the emitters' modules (lazily, in its loaders), so the two would make an import cycle
(``tests/project/test_structure.py``). What both read lives here, importing nothing of the
folder.
"""

from __future__ import annotations

__all__ = ["EXTRA", "MAX_LORA_RANKS", "NAME", "REQUIRES"]

NAME = "peft"  # the adapter's --emit kind
EXTRA = "peft"  # pip install 'ctxc[peft]'
REQUIRES = ("peft",)

# The values of a vLLM server's --max-lora-rank (vllm/config/lora.py MaxLoRARanks): the serving
# LoRA's declared ranks and the adapter's check (lora_rules.py) both read them.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
