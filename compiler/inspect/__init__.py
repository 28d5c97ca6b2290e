"""``ctxc inspect``: every residual MLP block, its parts and roles, what each update rule patches,
or why a block cannot be patched; rendered as text, JSON or HTML.
"""
