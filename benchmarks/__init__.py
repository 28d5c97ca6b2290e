"""ctxc's benchmarks, by kind: run each as ``python -m benchmarks.<kind>.<name>``."""
