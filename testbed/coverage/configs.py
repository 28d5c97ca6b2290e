"""The coverage matrix's tiny models: each class's default config shrunk, plus per-family overrides.

The generic shrink sets the sizes a config has (layers, width, heads, experts, vocabulary, ...) to
tiny values and keeps the kinds apart (multi-query stays multi-query, experts that are off stay
off); :data:`OVERRIDES` adds what a family needs on top. :func:`build_model` seeds the weights.
"""

from __future__ import annotations

from testbed.coverage.entries import Entry

__all__ = ["OVERRIDES", "SEED", "VOCAB", "build_model", "tiny_config"]

VOCAB = 128
SEED = 0

# Config keys the generic shrink sets, where a config has them (values for a tiny model).
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "word_embed_proj_dim")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num")
_FFN = (
    "intermediate_size",
    "n_inner",
    "ffn_dim",
    "ffn_hidden_size",
    "d_ff",
    "decoder_ffn_dim",
    "inner_hidden_size",
    "ffn_hidden_dim",
)
_FIXED: dict[str, object] = {
    "head_dim": 16,
    "kv_channels": 16,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "moe_ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "num_experts_per_token": 2,
    "top_k": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_kv_shared_layers": 0,  # KV sharing needs its layer kinds on both sides of the cut
    "vocab_size": VOCAB,
    "sliding_window": 8,
    "attention_chunk_size": 8,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "rotary_dim": 8,
    "initializer_range": 0.1,
    "init_std": 0.1,
    "use_cache": False,
}
_POSITIONS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len")
_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}

_QSA = {
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
}
# Layer 1 is a sliding layer after the shrink (two layer kinds kept); its MLA sizes, tiny, with
# head_dim = qk_nope + qk_rope as the config requires.
_DOTS3_SWA = {
    "per_layer_config": {
        "1": {
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "head_dim": 24,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
        }
    }
}

# Where the generic shrink fails: per-family config values on top of it (model_type -> kwargs).
# A dict value under a sub-config's name overrides that sub-config's fields.
OVERRIDES: dict[str, dict] = {
    # Routed experts by default but no top-k (None), which the router reads.
    "deepseek_v2": {"num_experts_per_tok": 2},
    # Expert counts and top-k all default to None, though its MoE layers read them.
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # No default rotary settings per layer kind, though the model reads them.
    "cohere_compass_text": {
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": 10000.0}
            for kind in ("full_attention", "sliding_attention")
        }
    },
    # Its shared transformer's weight tying needs two hybrid layers.
    "zamba": {
        "num_hidden_layers": 3,
        "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
    },
    # No default layer types, though the model reads them.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # Its QSA indexer's fields default to None but indexed layers read them (budget // ratio).
    "qwen4_exp_text": _QSA,
    # The same: its class is the text model's, so the text config is built directly.
    "qwen4_exp": _QSA,
    # The sliding layers' MLA sizes come from their own per-layer config, not the shrunk top.
    "dots3_note_text": _DOTS3_SWA,
    # The same: its class is the text model's, so the text config is built directly.
    "dots3_note": _DOTS3_SWA,
    # The attention reads attn_config.rope_theta (no config field) and clamps by clip_qkv.
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # The local encoder/decoder read the global transformer's width; a 500k-row hash table.
    "blt": {
        "encoder_config": {"hidden_size_global": 64},
        "decoder_config": {"hidden_size_global": 64},
        "encoder_hash_byte_group_vocab": 1024,
    },
    # Its language adapters need a language; the config has the field, None by default.
    "xmod": {"default_language": "en_XX"},
}


def _shrink(cls, overrides: dict, defaults: dict | None = None) -> dict:
    """Constructor kwargs for a tiny ``cls`` config: its defaults with the sizes shrunk.

    Args:
        cls: the config class.
        overrides: per-family values set last (a dict value: the overrides of a sub-config).
        defaults: the values to shrink (default: ``cls()``'s); a composite config's own default
            for a sub-config can differ from the sub-config class's.

    Returns:
        the keyword arguments (only what differs from the defaults, plus whole sub-configs).
    """
    defaults = cls().to_dict() if defaults is None else defaults
    kw = _sizes(defaults)
    _head_dim(defaults, kw)
    _positions_tokens_layers(defaults, kw)
    subs = getattr(cls, "sub_configs", {})
    for key, sub in subs.items():
        if isinstance(defaults.get(key), dict) and not hasattr(sub, "to_dict"):
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            sub_type = defaults[key].get("model_type", "")
            if sub_type in CONFIG_MAPPING:  # an AutoConfig (the lazy mapping has no .get)
                sub = CONFIG_MAPPING[sub_type]
        if isinstance(defaults.get(key), dict) and hasattr(sub, "to_dict"):
            kw[key] = {**defaults[key], **_shrink(sub, overrides.get(key, {}), defaults[key])}
    kw.update({k: v for k, v in overrides.items() if k not in subs})
    return kw


def _sizes(defaults: dict) -> dict:
    """The shrunk sizes: layers, width, heads, KV heads, FFN width and the fixed keys."""
    kw: dict = {}

    def put(key: str, value) -> None:
        if key in defaults and defaults[key] is not None:
            kw[key] = value

    for key in _LAYERS:
        put(key, 2)
    for key in _HIDDEN:
        put(key, 64)
    old_heads = next((defaults[k] for k in _HEADS if isinstance(defaults.get(k), int)), None)
    for key in _HEADS:
        put(key, 4)
    if "num_key_value_heads" in defaults and defaults["num_key_value_heads"] is None:
        kw["num_key_value_heads"] = 4  # None means multi-head, but some models read it as is
    for key in _KV_HEADS:
        old = defaults.get(key)
        if isinstance(old, int):  # keep multi-head, multi-query and grouped-query apart
            kw[key] = 4 if old == old_heads else 1 if old == 1 else 2
    for key in _FFN:
        put(key, 128)
    for key, value in _FIXED.items():
        old = defaults.get(key)
        if old is None or isinstance(old, bool) != isinstance(value, bool):
            continue
        if isinstance(old, int) and isinstance(value, int) and not isinstance(value, bool):
            # shrink only: never turn on experts, shared experts or dense layers that are off
            value = min(old, value) if key != "vocab_size" else value
            if key == "first_k_dense_replace" and old == 0:
                value = 0
        kw[key] = value
    return kw


def _head_dim(defaults: dict, kw: dict) -> None:
    """Set ``kw``'s head_dim (mutates ``kw``): 16, or the MLA query head's part it stands for."""
    if "head_dim" in defaults:  # also where its default is None but the model reads it
        kw["head_dim"] = 16
    if defaults.get("head_dim") is not None and defaults.get("head_dim") == defaults.get(
        "qk_rope_head_dim"
    ):  # multi-head latent attention: its head_dim is the rotary part of a query head
        kw["head_dim"] = kw["qk_rope_head_dim"]
    elif defaults.get("qk_rope_head_dim") and defaults.get("head_dim") == (
        defaults["qk_rope_head_dim"] + (defaults.get("qk_nope_head_dim") or 0)
    ):  # or the whole query head, rotary and plain parts
        kw["head_dim"] = kw["qk_rope_head_dim"] + kw.get("qk_nope_head_dim", 0)


def _positions_tokens_layers(defaults: dict, kw: dict) -> None:
    """Add positions, in-vocabulary special tokens and per-layer settings to ``kw`` (mutates)."""
    old_layers = next((defaults[k] for k in _LAYERS if isinstance(defaults.get(k), int)), None)
    for key in _POSITIONS:
        if isinstance(defaults.get(key), int):
            kw[key] = 256
    for key, value in _TOKENS.items():
        old = defaults.get(key)
        if isinstance(old, int) and old >= VOCAB:
            kw[key] = value
        elif isinstance(old, list):
            kw[key] = [t for t in old if t < VOCAB] or value
    if old_layers:  # per-layer lists (layer_types, mlp_layer_types, ...): keep two kinds
        for key, value in defaults.items():
            if isinstance(value, list) and len(value) == old_layers and key not in kw:
                other = [v for v in value if v != value[0]]
                kw[key] = [value[0], (other or value)[0]]
    n_layers = kw.get("num_hidden_layers", 2)
    for key, value in defaults.items():  # per-layer settings keyed by layer index
        if key == "id2label" or not isinstance(value, dict) or not value:
            continue
        if all(str(k).isdigit() for k in value):
            kw[key] = {k: v for k, v in value.items() if int(k) < n_layers}
    if "is_decoder" in defaults:
        kw["is_decoder"] = True


def tiny_config(entry: Entry):
    """A tiny random-model config for ``entry``: its defaults shrunk, float32, no KV cache.

    Args:
        entry: the class to build.

    Returns:
        the ``PretrainedConfig``.
    """
    import torch
    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    own = getattr(getattr(tf, entry.cls), "config_class", None)
    cls = own
    if entry.family in CONFIG_MAPPING:  # the lazy mapping's .get finds nothing
        cls = CONFIG_MAPPING[entry.family]
    if own is not None and own in getattr(cls, "sub_configs", {}).values():
        cls = own  # a text model registered under its multimodal model type (Emu3)
    config = cls(**_shrink(cls, OVERRIDES.get(entry.family, {})))
    config.use_cache = False
    config.dtype = torch.float32
    return config


def build_model(entry: Entry, seed: int = SEED):
    """The seeded tiny model of ``entry``, with random norm weights and biases (N(0, 0.5)).

    Args:
        entry: the class to build.
        seed: torch seed for the weights.

    Returns:
        ``(model, experts)``: the model in eval mode and the experts implementation asked for.
    """
    import torch
    import transformers as tf

    config = tiny_config(entry)
    torch.manual_seed(seed)
    cls = getattr(tf, entry.cls)
    experts = "batched_mm"
    try:  # grouped_mm leaves a custom op in the graph; the eager loop does not export
        model = cls._from_config(config, experts_implementation=experts, dtype=torch.float32)
    except (TypeError, ValueError):
        experts = "default"
        model = cls._from_config(config, dtype=torch.float32)
    model = model.float().eval()
    with torch.no_grad():  # zero or unit norm weights hide bugs (testbed/tiny_models.py)
        for param in model.parameters():
            if param.ndim == 1:
                param.normal_(0.0, 0.5)
    model.config.use_cache = False
    return model, experts
