"""Tiny random decoders built from Transformers' config classes (no download), and a tokenizer."""

from __future__ import annotations

import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["FAMILIES", "VOCAB", "build", "tiny_tokenizer"]

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
_GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]

FAMILIES: dict[str, tuple[str, str, dict]] = {
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(head_dim=16, sliding_window=8, layer_types=_GEMMA3_LAYERS),
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """A seeded tiny model of ``family`` with random norm weights, so every part matters."""
    config_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(tf, config_name)(**{**_COMMON, **extra})
    model = getattr(tf, model_name)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.normal_(0.0, 0.5)
    model.config.use_cache = False
    return model


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``VOCAB`` ids, with a BOS token."""
    words = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 4)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    from tokenizers.processors import TemplateProcessing

    core.post_processor = TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
