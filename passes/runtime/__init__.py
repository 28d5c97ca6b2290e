"""Running the graph: the full and reduced runs, deltas inserted as graph ops, banded attention,
segment compilation, and the LM head as the runtime applies it.
"""
