"""The key-value metadata of a GGUF model file: architecture, hyper-parameters, tokenizer.

For a model converted from a GGUF file (the bundled Gemma 3 270M) every key of that file but
its file type is copied as llama.cpp's converter wrote it, tokenizer included: the patch
changes weights only. Otherwise the keys are the inverse of Transformers' GGUF loader's
``GGUF_CONFIG_MAPPING`` (``transformers/integrations/ggml.py``) for the architecture, and the
tokenizer is written as llama.cpp's ``gpt2`` (byte-level BPE) vocabulary from a fast
tokenizer's ``tokenizer.json``; any other tokenizer model is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from ctxc.backends.gguf.names import GgufArch
from ctxc.core.errors import CtxcError

__all__ = ["copy_metadata", "write_metadata"]

# Keys the writer sets itself (GGUF.* are the reader's own header fields).
_OWN = ("general.file_type", "general.quantization_version", "general.type")


def copy_metadata(writer, source: Path) -> None:
    """Copy every key of the GGUF file ``source`` but its header and file type into ``writer``.

    Side effects: adds the keys to ``writer``.
    """
    import gguf

    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in _OWN or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def write_metadata(writer, model, tokenizer, arch: GgufArch) -> None:
    """Hyper-parameters from ``model.config`` and the tokenizer, under llama.cpp's keys.

    Side effects: adds the keys to ``writer``.

    Raises:
        CtxcError: the tokenizer is not a byte-level BPE fast tokenizer.
    """
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    cfg = model.config
    values = dict(vars(cfg))
    rope = getattr(cfg, "rope_parameters", None) or {}
    values.setdefault("rope_theta", rope.get("rope_theta"))
    values.setdefault("head_dim", cfg.hidden_size // cfg.num_attention_heads)
    table = GGUF_CONFIG_MAPPING.get(arch.arch, {})
    assert isinstance(table, dict)  # {GGUF key: config attribute}; mypy infers its values object
    mapping: dict[str, str | None] = dict(table)
    mapping.update({"attention.key_length": "head_dim", "attention.value_length": "head_dim"})
    writer.add_name(str(getattr(cfg, "name_or_path", "") or "ctxc patched model"))
    for key, attr in mapping.items():
        value = values.get(attr) if attr else None
        if value is None or isinstance(value, bool):
            continue
        if isinstance(value, int):
            writer.add_uint32(f"{arch.arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch.arch}.{key}", value)
    _write_bpe_vocab(writer, tokenizer, cfg.vocab_size, gguf)


def _write_bpe_vocab(writer, tokenizer, vocab_size: int, gguf) -> None:
    """llama.cpp's ``gpt2`` vocabulary (convert_hf_to_gguf.py ``_set_vocab_gpt2``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        kind = model.get("type") or type(tokenizer).__name__
        raise CtxcError(
            f"the GGUF writer stores byte-level BPE tokenizers only; this one is {kind} "
            "(a model converted from a GGUF file keeps that file's tokenizer)"
        )
    by_id = {i: t for t, i in model["vocab"].items()}
    special = {a["id"]: a["content"] for a in spec.get("added_tokens", [])}
    by_id.update(special)
    tokens, types = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        normal = i in by_id and i not in special
        types.append(
            gguf.TokenType.NORMAL
            if normal
            else gguf.TokenType.CONTROL
            if i in special
            else gguf.TokenType.UNUSED
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for what, tid in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id)):
        if tid is not None:
            getattr(writer, f"add_{what}_token_id")(tid)
    if tokenizer.pad_token_id is not None:
        writer.add_pad_token_id(tokenizer.pad_token_id)
