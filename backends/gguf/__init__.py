"""GGUF for llama.cpp: the patched model and a LoRA GGUF, each run in llama.cpp when it loads."""
