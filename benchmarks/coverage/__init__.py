"""The coverage matrix: every Transformers causal-LM class on a tiny random model."""
