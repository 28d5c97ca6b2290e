"""The solver: each block's patch from the full run's targets and the reduced run's values,
layer by layer (the update rules, RMS inversion, the post-norm scale, least-rounding magnitude).
"""
