"""Analysis passes over the fx graph: find the residual MLP blocks, their linears and norms,
classify nodes by controllability, plan what each update rule patches. Nothing here mutates.
"""
