"""bake."""
