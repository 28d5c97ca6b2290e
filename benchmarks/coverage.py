"""Coverage matrix: every ``*ForCausalLM`` class in Transformers, compiled on a tiny random model.

Enumerates the causal-LM auto mapping plus every ``*ForCausalLM`` name the package exports, builds
a tiny seeded float32 config for each by shrinking the class's defaults (a few per-family
overrides where the generic shrink fails), compiles a random context through ``ctxc.compile`` as
the CLI does, and sorts each class into exact / inexact / refused / failed / out of scope. Each
model runs in its own forked process with a timeout. Writes ``docs/coverage.md`` and
``docs/coverage.json``, so a new Transformers release shows what it broke or added.

    python benchmarks/coverage.py [--only llama,gpt2] [--subset ci] [--jobs 1] [--timeout 120]
        [--out docs] [--list] [--strict] [--merge] [--render]

``--merge`` reruns the selected entries into an existing ``coverage.json`` (after a fix);
``--render`` rewrites ``coverage.md`` from it. ``tests/integration/test_coverage.py`` runs the
``ci`` subset.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import sys
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CI_SUBSET",
    "FAINT",
    "OVERRIDES",
    "TOL",
    "Entry",
    "build_model",
    "entries",
    "main",
    "run_entry",
    "run_isolated",
    "summarise",
    "tiny_config",
    "write_reports",
]

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
# A control figure below this: the random model hardly sees the context (a vacuous "exact").
FAINT = 1e-2
VOCAB = 128
SEED = 0
# Context 23 random ids + a one-token query, as the CLI's default query (the context's last token).
N_IDS = 24

# One family per block pattern of ARCHITECTURES.md: pre-norm (Llama), sandwich (Gemma 3), Conv1D
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
OVERRIDES: dict[str, dict] = {
    # Defaults with routed experts but no top-k, or a top-k but no experts.
    "deepseek_v2": {"num_experts_per_tok": 2},
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
    "qwen4_exp": _QSA,  # its class is the text model's: the text config is built directly
    # The sliding layers' MLA sizes come from their own per-layer config, not the shrunk top.
    "dots3_note_text": _DOTS3_SWA,
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
    kw: dict = {}

    def put(key: str, value) -> None:
        if key in defaults and defaults[key] is not None:
            kw[key] = value

    old_layers = next((defaults[k] for k in _LAYERS if isinstance(defaults.get(k), int)), None)
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
    for key, sub in getattr(cls, "sub_configs", {}).items():
        if isinstance(defaults.get(key), dict) and not hasattr(sub, "to_dict"):
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            sub_type = defaults[key].get("model_type", "")
            if sub_type in CONFIG_MAPPING:  # an AutoConfig (the lazy mapping has no .get)
                sub = CONFIG_MAPPING[sub_type]
        if isinstance(defaults.get(key), dict) and hasattr(sub, "to_dict"):
            kw[key] = {**defaults[key], **_shrink(sub, overrides.get(key, {}), defaults[key])}
    subs = getattr(cls, "sub_configs", {})
    kw.update({k: v for k, v in overrides.items() if k not in subs})
    return kw


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
    with torch.no_grad():  # zero or unit norm weights hide bugs (tests/tiny_models.py)
        for param in model.parameters():
            if param.ndim == 1:
                param.normal_(0.0, 0.5)
    model.config.use_cache = False
    return model, experts


def run_entry(entry: Entry, seed: int = SEED) -> dict:
    """Build and compile ``entry`` in this process; never raises.

    Args:
        entry: the class to compile.
        seed: seed of the weights and of the random context.

    Returns:
        the result record (``status`` one of exact, inexact, refused, failed, out of scope).
    """
    rec: dict = {"family": entry.family, "cls": entry.cls, "kind": entry.kind}
    if entry.scope:
        return {**rec, "status": "out of scope", "reason": entry.scope}
    start = time.perf_counter()
    stage = "config"
    try:
        import torch

        import ctxc
        from ctxc.errors import SolveError, UnpatchableError, UntraceableError

        stage = "build"
        model, rec["experts"] = build_model(entry, seed)
        vocab = model.get_input_embeddings().weight.shape[0]
        gen = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(4, min(vocab, VOCAB), (N_IDS,), generator=gen).tolist()
        stage = "forward"  # a failure here is the tiny config's, not ctxc's
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
        stage = "compile"
        try:
            rep = ctxc.compile(model, None, context_ids=ids[:-1], query_ids=ids[-1:]).report
        except UntraceableError as exc:  # the frontend's refusal: its first reason leads
            rec.update(status="refused", error=type(exc).__name__, reasons=[_untraceable(exc)])
        except (UnpatchableError, SolveError) as exc:
            rec.update(_refusal(model, exc))
            stage = "compile --skip-unpatchable"
            try:  # what patching the rest reaches, for the record
                rep = ctxc.compile(
                    model, None, context_ids=ids[:-1], query_ids=ids[-1:], skip_unpatchable=True
                ).report
                rec["skip_unpatchable"] = _figures(rep)
            except Exception as exc2:
                rec["skip_unpatchable"] = {"error": _first_line(exc2)}
        else:
            rec.update(_figures(rep))
            exact = rep.emitted.max_abs_logit_diff <= TOL and not rep.rejections
            rec["status"] = "exact" if exact else "inexact"
        rec["blocks"] = _block_kinds(model)
    except Exception as exc:  # the record says what broke, at which stage
        rec.update(
            status="failed",
            stage=stage,
            error=type(exc).__name__,
            message=_first_line(exc),
            where=_where(exc),
        )
    rec["seconds"] = round(time.perf_counter() - start, 2)
    return rec


def _figures(rep) -> dict:
    e, c = rep.emitted, rep.control
    return {
        "max_abs_logit_diff": e.max_abs_logit_diff,
        "top1_match": bool(e.top1_match),
        "control_max_abs_logit_diff": c.max_abs_logit_diff,
        "solver_max_abs_logit_diff": rep.patched.max_abs_logit_diff,
        "patched_blocks": sum(b.patched for b in rep.blocks),
        "rejections": list(rep.rejections),
        "frontend": rep.frontend,
    }


def _untraceable(exc) -> str:
    """The frontend's reason: the data-dependent branch, without every rung's export error."""
    text = str(exc).removeprefix("every export rung failed: ")
    return "export: " + text.split("; ", 1)[0]


def _refusal(model, exc) -> dict:
    from ctxc.errors import SolveError

    if isinstance(exc, SolveError):
        reasons = [f"{exc.block}: {exc.reason}"]
    else:
        reasons = [str(exc)]
        try:  # the locator's reasons one by one (the error joins them)
            from ctxc.pipeline import traced_blocks

            rejections = traced_blocks(model)[1].rejections
            if rejections:
                reasons = [str(r) for r in rejections]
        except Exception:
            pass
    return {"status": "refused", "error": type(exc).__name__, "reasons": reasons}


def _block_kinds(model) -> dict:
    """Count of located blocks by shape (output control, parallel, trailing norm, gain, ...)."""
    try:
        from ctxc.pipeline import traced_blocks

        blocks = traced_blocks(model)[1]
    except Exception as exc:
        return {"error": _first_line(exc)}
    kinds: Counter[str] = Counter()
    for b in blocks.blocks:
        tags = [b.output_control]
        if b.parallel:
            tags.append("parallel")
        if b.norm is not None:
            tags.append("post-norm")
        if b.trailing_norm:
            tags.append("post-LN")
        if b.gain != 1.0:
            tags.append("gain")
        if b.others:
            tags.append("shared")
        kinds["+".join(tags)] += 1
    return {"count": len(blocks.blocks), "kinds": dict(kinds), "rejected": len(blocks.rejections)}


def _first_line(exc: BaseException) -> str:
    """The message's first line; with the next when the first only introduces it (``...:``)."""
    text = [t.strip() for t in str(exc).strip().splitlines() if t.strip()]
    if len(text) > 1 and text[0].endswith(":"):
        text = [f"{text[0]} {text[1]}"]
    return (text[0] if text else "")[:300]


def _where(exc: BaseException) -> str:
    """The innermost frame of the traceback, as ``file:line`` under its package."""
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return ""
    frame = tb[-1]
    path = frame.filename
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{frame.lineno}"


# -- isolation -------------------------------------------------------------------------------------


def _child(entry: Entry, conn) -> None:
    import torch

    torch.set_num_threads(1)  # many children may share few cores
    conn.send(run_entry(entry))
    conn.close()


def run_isolated(entry: Entry, timeout: float) -> dict:
    """Run :func:`run_entry` in a forked process (imports inherited), killed after ``timeout``.

    Args:
        entry: the class to compile.
        timeout: seconds before the process is killed and the entry recorded as failed.

    Returns:
        the result record.
    """
    if entry.scope:
        return run_entry(entry)
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(entry, send), daemon=True)
    start = time.perf_counter()
    proc.start()
    send.close()
    rec = None
    if recv.poll(timeout):
        try:
            rec = recv.recv()
        except EOFError:
            rec = None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if rec is None:
        seconds = round(time.perf_counter() - start, 2)
        code = proc.exitcode
        if code is not None and code < 0 and seconds < timeout:
            why = f"killed by signal {-code} (out of memory?)"
            error = "Killed"
        else:
            why, error = f"no result within {timeout:g} s", "Timeout"
        rec = {
            "family": entry.family,
            "cls": entry.cls,
            "kind": entry.kind,
            "status": "failed",
            "stage": "process",
            "error": error,
            "message": why,
            "seconds": seconds,
        }
    return rec


def _run_all(todo: list[Entry], jobs: int, timeout: float, progress) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    # Threads only wait on forked children; the parent itself runs no torch op.
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(run_isolated, e, timeout) for e in todo]
        results = []
        for i, fut in enumerate(futures):
            rec = fut.result()
            progress(i + 1, len(todo), rec)
            results.append(rec)
    return results


# -- reports ---------------------------------------------------------------------------------------


def _group_key(text: str) -> str:
    """A reason or message with module paths and numbers blanked, to group like with like."""
    text = re.sub(r"\b(?!aten\.)[\w-]+(\.[\w-]+){2,}\b", "<path>", text)
    text = re.sub(r"(?<![\w.])-?\d+(\.\d+)?(e[-+]?\d+)?\b", "#", text)
    return text[:200]


def _versions() -> dict:
    import torch
    import transformers

    import ctxc

    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "ctxc": ctxc.__version__,
        "python": platform.python_version(),
    }


def summarise(results: list[dict]) -> dict:
    """Counts by status, and failures and refusals grouped by their normalised first line.

    Args:
        results: the records of :func:`run_entry`.

    Returns:
        ``counts``, ``refused`` and ``failed`` (group text -> sorted families).
    """
    counts = Counter(r["status"] for r in results)
    refused: dict[str, set[str]] = defaultdict(set)
    failed: dict[str, set[str]] = defaultdict(set)
    inexact: dict[str, float] = {}
    for r in results:
        if r["status"] == "refused":
            for reason in r.get("reasons", []):
                refused[_group_key(reason.split(": ", 1)[-1])].add(r["family"])
        elif r["status"] == "failed":
            failed[f"{r['error']}: {_group_key(r.get('message', ''))}"].add(r["family"])
        elif r["status"] == "inexact":
            inexact[r["family"]] = r["max_abs_logit_diff"]
    before = [r["family"] for r in results if r.get("stage") in ("config", "build", "forward")]
    return {
        "failed_before_ctxc": sorted(before),
        "exact_faint": sorted(r["family"] for r in results if r["status"] == "exact" and _faint(r)),
        "classes": len({r["cls"] for r in results}),
        "entries": len(results),
        "counts": dict(counts),
        "refused": {k: sorted(v) for k, v in sorted(refused.items(), key=lambda kv: -len(kv[1]))},
        "failed": {k: sorted(v) for k, v in sorted(failed.items(), key=lambda kv: -len(kv[1]))},
        "inexact": inexact,
    }


def _faint(r: dict) -> bool:
    """The unpatched control is already close: exactness says little about this model."""
    return r.get("control_max_abs_logit_diff", 1.0) <= FAINT


def _fmt(x) -> str:
    return "" if x is None else f"{x:.2g}"


def _cell(r: dict) -> str:
    status = r["status"]
    if status in ("exact", "inexact"):
        control = _fmt(r["control_max_abs_logit_diff"])
        faint = ", the context hardly matters" if _faint(r) else ""
        return f"{status}: {_fmt(r['max_abs_logit_diff'])} (control {control}{faint})"
    if status == "refused":
        text = "; ".join(r.get("reasons", []))
        skip = r.get("skip_unpatchable", {})
        if "max_abs_logit_diff" in skip:
            text += f" [rest patched: {_fmt(skip['max_abs_logit_diff'])}]"
        return f"refused: {text}"
    if status == "failed":
        return f"failed ({r.get('stage', '')}): {r['error']}: {r.get('message', '')}"
    return f"out of scope: {r.get('reason', '')}"


def _blocks_cell(r: dict) -> str:
    b = r.get("blocks")
    if not b or "count" not in b:
        return ""
    kinds = ", ".join(f"{n}x {k}" for k, n in sorted(b["kinds"].items()))
    rejected = f", {b['rejected']} rejected" if b.get("rejected") else ""
    return f"{b['count']}: {kinds}{rejected}" if kinds else f"0{rejected}"


def write_reports(results: list[dict], meta: dict, out_dir: Path) -> None:
    """Write ``coverage.json`` and ``coverage.md`` under ``out_dir``.

    Args:
        results: the records, one per entry.
        meta: versions, settings and run time for the header.
        out_dir: the folder (``docs/``).
    """
    summary = summarise(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "summary": summary, "results": results}
    (out_dir / "coverage.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    v = meta["versions"]
    c = summary["counts"]
    lines = [
        "# Coverage matrix: every `*ForCausalLM` class in Transformers",
        "",
        f"Generated by `python benchmarks/coverage.py {meta['args']}` with transformers "
        f"{v['transformers']}, torch {v['torch']}, ctxc {v['ctxc']} (Python {v['python']}), "
        f"{meta['date']}, {meta['seconds']:.0f} s.",
        "",
        *(
            [f"Entries rerun since (merged): `{'`, `'.join(meta['merged'])}`.", ""]
            if meta.get("merged")
            else []
        ),
        f"Tiny random float32 models (the class's default config shrunk: {meta['shape']}; "
        "random norm weights and biases; seed 0), one random context of 23 ids and a one-token "
        "query through `ctxc.compile` (stable rule). **exact**: the emitted model fed the query "
        f"alone is within {TOL:g} (max |logit diff|) of the model fed context + query; the "
        "unpatched control's figure is in brackets. Each class runs in its own process with a "
        f"{meta['timeout']:g} s timeout.",
        "",
        "## Summary",
        "",
        f"- `*ForCausalLM` classes: {summary['classes']} ({summary['entries']} model types "
        "with their class)",
    ]
    for status in ("exact", "inexact", "refused", "failed", "out of scope"):
        lines.append(f"- {status}: {c.get(status, 0)}")
        if status == "exact" and summary["exact_faint"]:
            lines[-1] += (
                f" (of which {len(summary['exact_faint'])} with an unpatched control within "
                f"{FAINT:g}: {', '.join(summary['exact_faint'])})"
            )
        if status == "failed" and summary["failed_before_ctxc"]:
            lines[-1] += (
                f" (of which {len(summary['failed_before_ctxc'])} before ctxc ran: the tiny "
                "config or the eager forward pass failed)"
            )
    lines += ["", "### Refusal reasons (families)", ""]
    lines += [f"- {k}: {', '.join(v)}" for k, v in summary["refused"].items()] or ["- none"]
    lines += ["", "### Failures, by error (families)", ""]
    lines += [f"- `{k}`: {', '.join(v)}" for k, v in summary["failed"].items()] or ["- none"]
    if summary["inexact"]:
        lines += ["", "### Inexact (max |logit diff|)", ""]
        lines += [f"- {k}: {x:.3g}" for k, x in sorted(summary["inexact"].items())]
    lines += [
        "",
        "## Matrix",
        "",
        "| family | class | kind | blocks found | result |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["family"], r["cls"])):
        cell = _cell(r).replace("|", "\\|")
        lines.append(f"| {r['family']} | {r['cls']} | {r['kind']} | {_blocks_cell(r)} | {cell} |")
    (out_dir / "coverage.md").write_text("\n".join(lines) + "\n")


def _meta_args(argv: list[str] | None) -> str:
    """The command line as the report header shows it (without ``--out``: a local path)."""
    args = list(argv if argv is not None else sys.argv[1:])
    if "--out" in args:
        i = args.index("--out")
        del args[i : i + 2]
    return " ".join(a for a in args if not a.startswith("--out="))


def main(argv: list[str] | None = None) -> int:
    """Run the matrix (or a part of it) and write the reports.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        the exit code: 0, or 1 when ``--strict`` and an entry run is not exact.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma list of families (model types)")
    parser.add_argument("--subset", choices=["ci"], default=None)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per model")
    parser.add_argument("--out", default=str(ROOT / "docs"), help="folder for coverage.md/json")
    parser.add_argument("--list", action="store_true", help="print the entries and exit")
    parser.add_argument("--strict", action="store_true", help="exit 1 unless all run are exact")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace only these entries in an existing coverage.json (a rerun after a fix)",
    )
    parser.add_argument(
        "--render", action="store_true", help="rewrite coverage.md from coverage.json and exit"
    )
    args = parser.parse_args(argv)
    if args.render:
        doc = json.loads((Path(args.out) / "coverage.json").read_text())
        write_reports(doc["results"], doc["meta"], Path(args.out))
        return 0
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    import ctxc  # noqa: F401  (imported once here; forked children inherit it)

    wanted = set(CI_SUBSET) if args.subset == "ci" else set()
    wanted |= {f for f in args.only.split(",") if f}
    todo = entries(wanted)
    unknown = wanted - {e.family for e in todo}
    if unknown:
        parser.error(f"unknown families: {', '.join(sorted(unknown))}")
    if args.list:
        for e in todo:
            print(f"{e.family:28} {e.cls:44} {e.kind:18} {e.scope}")
        return 0

    def progress(i: int, n: int, rec: dict) -> None:
        print(f"[{i}/{n}] {rec['family']:26} {rec.get('seconds', 0):6.1f}s {_cell(rec)[:140]}")
        sys.stdout.flush()

    start = time.perf_counter()
    results = _run_all(todo, args.jobs, args.timeout, progress)
    meta = {
        "versions": _versions(),
        "args": _meta_args(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": time.perf_counter() - start,
        "timeout": args.timeout,
        "tolerance": TOL,
        "shape": "2 layers, hidden 64, 4 heads (2 KV heads where grouped), head dim 16, "
        "intermediate 128, <= 4 experts with top-2, vocabulary 128, window 8",
    }
    if args.merge and (Path(args.out) / "coverage.json").exists():
        old = json.loads((Path(args.out) / "coverage.json").read_text())
        rerun = {(r["family"], r["cls"]) for r in results}
        kept = [r for r in old["results"] if (r["family"], r["cls"]) not in rerun]
        meta = {**old["meta"], "versions": meta["versions"], "date": meta["date"]}
        meta["merged"] = [*old["meta"].get("merged", []), _meta_args(argv)]
        results = kept + results
    write_reports(results, meta, Path(args.out))
    s = summarise(results)
    print(json.dumps(s["counts"]))
    ran = [r for r in results if r["status"] != "out of scope"]
    return 1 if args.strict and any(r["status"] != "exact" for r in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
