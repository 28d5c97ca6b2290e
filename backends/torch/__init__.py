"""The patched PyTorch/Transformers model (``model/``): written in shards, checked reloaded."""

from __future__ import annotations

from ctxc.backends.base import Backend, Emitter

__all__ = ["DECLARED"]


def _emitter() -> Emitter:
    from ctxc.backends.torch.check import emit_torch_checked

    return emit_torch_checked


DECLARED = (
    Backend(
        "torch",
        writes="model/",
        meaning="a Transformers model folder",
        status="writing model/ and reloading it",
        emitter=_emitter,
        takes=("tokenizer", "folder", "baked"),
        alone=("model folder", "writing the model folder and reloading it"),
        emitted=True,  # reloaded by plain Transformers: what a user loads
        dispersed=True,  # written shard by shard (backends/torch/shards.py)
    ),
)
