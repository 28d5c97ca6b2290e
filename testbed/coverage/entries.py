"""The coverage matrix's entries: every ``*ForCausalLM`` class in Transformers, classified.

Which classes the matrix lists (the causal-LM auto mapping plus every exported ``*ForCausalLM``
name), what kind of model each is, and why a class is out of scope.
``benchmarks/coverage/matrix.py`` runs them; ``testbed/coverage/configs.py`` builds each one's
tiny model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CI_SUBSET", "Entry", "entries"]

# One family per block pattern of block-shapes.md: pre-norm (Llama), sandwich (Gemma 3), Conv1D
# (GPT-2), parallel with FalconLinear (Falcon), post-sublayer norm (OLMo 2), MoE (Mixtral),
# parallel with one norm (Phi), MoE with a gated shared expert (Qwen2-MoE); and one issue 9
# fixed: a residual carried back scaled by a trainable vector, MoE layers after a dense one (Doge).
CI_SUBSET = (
    "llama",
    "gemma3_text",
    "gpt2",
    "falcon",
    "olmo2",
    "mixtral",
    "phi",
    "qwen2_moe",
    "doge",
)

# Not decoder transformers over token ids: the block model ctxc patches does not apply.
_RECURRENT = {
    "mamba": "state-space model (Mamba): no attention and no MLP block",
    "mamba2": "state-space model (Mamba-2): no attention and no MLP block",
    "falcon_mamba": "state-space model (Mamba): no attention and no MLP block",
    "rwkv": "RWKV: recurrent time mixing; its channel mix shifts tokens (not a position-wise MLP)",
    "xlstm": "xLSTM: recurrent cells, no attention",
}
# Decoders whose config does not say ``is_encoder_decoder`` but that cross-attend to an encoder.
_CROSS_ATTENTION = {"trocr"}
_OTHER_SCOPE = {
    "gemma4_assistant": "draft model: every layer reads the target model's KV states",
    "gemma4_unified_assistant": "draft model: every layer reads the target model's KV states",
    "reformer": "Reformer: reversible layers (two residual streams) with LSH/chunked attention",
    "xlnet": "XLNet: two-stream permutation LM with relative segment attention",
    "musicgen": "MusicGen decoder: audio codebooks ([batch * codebooks, seq] ids), not text",
    "musicgen_melody": "MusicGen decoder: audio codebooks ([batch * codebooks, seq] ids), not text",
    # Position t embeds codebook t - 1's ids and reads codebook t's head; position 0 (the
    # backbone's state) gets no logits, so a query fed alone has no next-token distribution.
    "csm_depth_decoder_model": "CSM depth decoder: the head is chosen by absolute position (one "
    "per audio codebook) and position 0 has none: a one-token query gives no logits",
}
# Families whose model needs a package that cannot be installed beside this torch, by family:
# (module, reason). Checked at run time: where the module imports, the family is compiled.
_NEEDS = {
    "gemma3n": (
        "timm",
        "its vision tower needs timm, which needs torchvision: PyPI's torchvision 0.28.0 for "
        "torch 2.13 links libc10_cuda.so, absent from a CPU-only torch (the text decoder is "
        "covered as gemma3n_text)",
    ),
}

# Sub-config names of models that take other modalities besides text.
_MODALITY = r"vision|visual|image|audio|speech|vq"


@dataclass(frozen=True)
class Entry:
    """One ``*ForCausalLM`` class under one model type.

    Attributes:
        family: the model type (the auto mapping's key), e.g. ``llama``.
        cls: the model class name.
        kind: ``decoder``, ``multimodal`` (a decoder with other-modality sub-configs, fed ids
            only), ``encoder-as-decoder`` (a BERT-style stack run with ``is_decoder``),
            ``encoder-decoder`` (the decoder half of one), ``recurrent`` or ``other``.
        scope: the out-of-scope reason, or ``""`` when it is compiled.
        mapped: True when the causal-LM auto mapping names it; False when found by the scan.
    """

    family: str
    cls: str
    kind: str
    scope: str = ""
    mapped: bool = True


def entries(only: set[str] | frozenset[str] = frozenset()) -> list[Entry]:
    """Every ``*ForCausalLM`` class of the installed Transformers, classified.

    Args:
        only: model types to keep (all when empty); the scan of exported names, which imports
            the classes it finds, is skipped when the auto mapping has them all.

    Returns:
        the auto mapping's (model type, class) pairs, then the exported ``*ForCausalLM`` classes
        it does not name (their model type from their config class), sorted by family.
    """
    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    pairs: list[tuple[str, str, bool]] = []
    for family, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        for name in (names,) if isinstance(names, str) else names:
            pairs.append((family, name, True))
    named = {name for _, name, _ in pairs}
    scan = not only or not only <= {family for family, _, _ in pairs}
    for name in sorted(n for n in dir(tf) if n.endswith("ForCausalLM") and n not in named):
        if name.startswith("Auto") or not scan:
            continue
        try:  # the scan imports only these few classes, for their config class
            family = getattr(tf, name).config_class.model_type
        except Exception:
            family = "?"
        pairs.append((family, name, False))
    out = []
    for family, name, mapped in sorted(pairs):
        if only and family not in only:
            continue
        kind, scope = _classify(family, name, CONFIG_MAPPING)
        out.append(Entry(family, name, kind, scope, mapped))
    return out


def _classify(family: str, name: str, config_mapping) -> tuple[str, str]:
    if family in _RECURRENT:
        return "recurrent", _RECURRENT[family]
    if family in _OTHER_SCOPE:
        return "other", _OTHER_SCOPE[family]
    if family in _NEEDS and not _importable(_NEEDS[family][0]):
        return "multimodal", _NEEDS[family][1]
    try:
        defaults = config_mapping[family]()
    except Exception:
        return "decoder", ""
    if getattr(defaults, "is_encoder_decoder", False) or family in _CROSS_ATTENTION:
        return "encoder-decoder", (
            "decoder half of an encoder-decoder model (cross-attention to an encoder)"
        )
    if "type_vocab_size" in defaults.to_dict():
        # BERT-style encoder stacks, causal with ``is_decoder``: in scope.
        return "encoder-as-decoder", ""
    subs = " ".join(getattr(type(defaults), "sub_configs", {}))
    if name.endswith("ForConditionalGeneration") or re.search(_MODALITY, subs):
        # Fed token ids only; a class whose config is the text part builds just the decoder.
        return "multimodal", ""
    return "decoder", ""


def _importable(module: str) -> bool:
    """Whether ``module`` imports here (timm imports torchvision, whose ops may fail to load)."""
    try:
        __import__(module)
    except Exception:
        return False
    return True
