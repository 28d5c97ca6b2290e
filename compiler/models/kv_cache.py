"""The KV cache's name across Transformers 5.x: ``past_key_values`` became ``cache``.

Transformers 5.2x takes both as a forward argument and warns on ``past_key_values`` ("will be
removed in version 5.40.0"); its outputs hold ``cache`` (``CausalLMOutputWithPast``), older
ones ``past_key_values``. pyproject admits ``transformers<6``, so every call that continues a
cache names it as the model's ``forward`` does. Analysis only: nothing is mutated.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["cache_arg", "cache_of", "with_cache"]


def cache_arg(model: torch.nn.Module) -> str:
    """The name ``model.forward`` takes its KV cache by: ``cache`` or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def with_cache(model: torch.nn.Module, cache) -> dict:
    """``{name: cache}`` for ``model(**inputs, **with_cache(model, cache))``."""
    return {cache_arg(model): cache}


def cache_of(out):
    """The KV cache a forward returned (``out.cache``, or ``out.past_key_values`` before 5.x)."""
    got = getattr(out, "cache", None)
    return got if got is not None else getattr(out, "past_key_values", None)
