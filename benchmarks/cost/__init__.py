"""What ctxc costs: time and memory of compile, generate, long contexts, offload."""
