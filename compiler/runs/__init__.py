"""Runs of the model as the user's runtime computes them: the full context + query reference, its
attention semantics from the config, image contexts, and the model run with a patch's weights.
"""
