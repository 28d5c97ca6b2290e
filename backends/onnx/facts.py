"""What the ONNX declaration and the ONNX emitters both read, torch-free.

A module of the folder does not import the folder's ``__init__.py``: the declaration there
imports the emitters' modules (lazily, in its loaders), so the two would make an import cycle
(``tests/project/test_structure.py``). What both read lives here, importing nothing of the
folder.
"""

from __future__ import annotations

__all__ = ["EXTRA", "NAME", "REQUIRES"]

NAME = "onnx"  # the baked model's --emit kind
EXTRA = "onnx"  # pip install 'ctxc[onnx]'
REQUIRES = ("onnx", "onnxruntime", "onnxscript")
