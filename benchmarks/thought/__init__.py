"""Thought patches: a context's effect compiled from the model's own generated text."""
