"""Tiny random decoders built from Transformers' config classes (no download), and a tokenizer."""

from __future__ import annotations

import functools

import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "ALL",
    "FAMILIES",
    "MOE",
    "SHAPES",
    "VOCAB",
    "bpe_tokenizer",
    "build",
    "build_any",
    "shared",
    "tiny_tokenizer",
]

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


# Every other block shape of ARCHITECTURES.md, two layers each
# (see tests/integration/test_block_shapes.py).
_TWO = {**_COMMON, "num_hidden_layers": 2}
# Weights at the default 0.02 leave these models nearly blind to the context (unpatched logits
# move by ~2e-3); a wider init makes the context matter, so the exactness tests can fail.
_WIDE = dict(initializer_range=0.1)
_GPT = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, n_inner=128, **_WIDE)
_OPT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    ffn_dim=128,
    max_position_embeddings=256,
    word_embed_proj_dim=64,
    pad_token_id=0,
    init_std=0.1,
)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
SHAPES: dict[str, tuple[str, str, dict]] = {
    # A: pre-norm sequential
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_TWO, pad_token_id=0)),  # fused gate_up
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(_TWO)),  # LayerNorm with bias
    # plain MLP with biases
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(_TWO, **_WIDE)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT)),  # Conv1D: addmm, W [in, out]
    "gpt_neox_seq": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(_TWO, use_parallel_residual=False, **_WIDE),
    ),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(_OPT)),  # fc1/fc2 on the layer, [seq, d] rows
    # A*: scaled branch
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            _TWO,
            residual_multiplier=0.37,
            embedding_multiplier=2.0,
            logits_scaling=3.0,
            attention_multiplier=0.3,
            **_WIDE,
        ),
    ),
    # B1/B2: parallel attention and MLP, one or two norms
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(_GPT, rotary_dim=8)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_TWO, **_WIDE)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(_TWO, pad_token_id=0, **_WIDE)),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(_TWO, use_parallel_residual=True, **_WIDE),
    ),
    "falcon": (  # new architecture, two norms, FalconLinear (x @ W.T + b)
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            ffn_hidden_size=128,
            max_position_embeddings=256,
            bias=True,
            **_WIDE,
        ),
    ),
    # C: post-sublayer norm only; D: sandwich norms
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_TWO, pad_token_id=0)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(_TWO, head_dim=16, sliding_window=8, layer_types=_GEMMA3_LAYERS[:2]),
    ),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(_TWO, head_dim=16, pad_token_id=0)),
    # E: classic post-LN
    "opt_post": ("OPTConfig", "OPTForCausalLM", dict(_OPT, do_layer_norm_before=False)),
    # MoE (experts as index + bmm: experts_implementation="batched_mm")
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(_TWO, num_local_experts=4, **_MOE)),
    "qwen2_moe": (  # shared expert with a sigmoid gate
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(_TWO, num_experts=4, shared_expert_intermediate_size=64, **_MOE),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(_TWO, num_experts=4, head_dim=16, norm_topk_prob=True, **_MOE),
    ),
    # experts as one linear per bank slice over split rows, summed by index_add (issue 9)
    "jetmoe": (
        "JetMoeConfig",
        "JetMoeForCausalLM",
        dict(_TWO, num_local_experts=4, num_experts_per_tok=2, kv_channels=16, **_WIDE),
    ),
}
MOE = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "jetmoe"})
ALL = tuple(sorted(FAMILIES) + sorted(SHAPES))


def build_any(name: str, seed: int = 0) -> torch.nn.Module:
    """A seeded tiny model of any family in :data:`FAMILIES` or :data:`SHAPES`."""
    if name in FAMILIES:
        return build(name, seed)
    config_name, model_name, extra = SHAPES[name]
    torch.manual_seed(seed)
    config = getattr(tf, config_name)(**extra)
    cls = getattr(tf, model_name)
    if name in MOE:  # grouped_mm leaves a custom op in the graph (ARCHITECTURES.md)
        model = cls._from_config(config, experts_implementation="batched_mm")
    else:
        model = cls(config)
    return _randomise(model.eval())


@functools.cache
def shared(name: str) -> torch.nn.Module:
    """One model per family for the whole test session, for tests that do not modify it
    (``ctxc.compile`` leaves a model as it was, and caches its trace on the object)."""
    return build_any(name)


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """A seeded tiny model of ``family`` with random norm weights, so every part matters."""
    config_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(tf, config_name)(**{**_COMMON, **extra})
    model = getattr(tf, model_name)(config).eval()
    return _randomise(model)


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
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


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE tokenizer over the tiny vocabulary (the GGUF writer stores BPE vocabularies).

    ``w``, the digits, and words ``w0``, ``w1``, ... built from them by merges: llama.cpp
    refuses a BPE vocabulary without merges, and gguf-py cannot write an empty list.
    """
    pieces = ["<pad>", "<bos>", "<eos>", "<unk>", "w", *"0123456789"]
    words = [f"w{i}" for i in range(VOCAB - len(pieces))]
    merges = [(w[:-1], w[-1]) for w in words]  # w1 + 2 -> w12
    vocab = {t: i for i, t in enumerate(pieces + words)}
    core = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
