"""The patched PyTorch/Transformers model (``model/``): written in shards, checked reloaded."""
