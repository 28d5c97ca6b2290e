"""The bottom layer: errors, token ids, fidelity metrics, every threshold, artefact checks, the
cache folder, interrupts, the compile report, per-block statistics and the arithmetic of a delta.

Nothing here imports another ctxc layer (pyproject's [tool.importlinter]).
"""
