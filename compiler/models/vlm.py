"""Vision-language models: how to tell one, load it, find its processor, and what ctxc leaves.

A vision-language model is a Transformers model whose config has a ``vision_config``. ctxc
patches its language model only: the blocks are found in the text path's graph, which the vision
tower and projector never enter (``compiler/runs/image_run.py``). What stays untouched is read
from
that graph too: the parameters the text path never reads.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ctxc.core.errors import CtxcError, missing_package_error

__all__ = [
    "auto_model_class",
    "is_vision_language",
    "load_processor",
    "untouched_modules",
]


def is_vision_language(model_or_config) -> bool:
    """Whether a model (or its config) has a vision tower (a ``vision_config``)."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "vision_config", None) is not None


def auto_model_class(config):
    """The Transformers auto class that loads a model of ``config`` whole.

    Returns:
        ``AutoModelForImageTextToText`` for a vision-language config (vision tower included;
        LLaVA and others are not causal-LM classes), else ``AutoModelForCausalLM``.
    """
    import transformers

    if is_vision_language(config):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def load_processor(model: torch.nn.Module, spec: str | None = None):
    """The model's processor (tokenizer and image processor), from the folder it was loaded from.

    Args:
        model: a vision-language model loaded by ``from_pretrained`` (its ``name_or_path``).
        spec: how the user named the model, for messages.

    Returns:
        the processor.

    Raises:
        CtxcError: the model is text-only, its folder has no processor (no image processor
            config), or the processor needs a library that is not installed (torchvision,
            timm, Pillow), in one line naming the model (and the package).
    """
    name = spec or str(getattr(model, "ctxc_name", "") or getattr(model, "name_or_path", ""))
    if not is_vision_language(model):
        raise CtxcError(
            f"model {name!r} is a text-only model ({type(model).__name__}): it takes no images"
        )
    folder = Path(str(getattr(model, "name_or_path", "") or ""))
    if not folder.is_dir():
        raise CtxcError(f"model {name!r}: no local folder to load its processor from")
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(folder))
    except ImportError as exc:  # a fast image or video processor's torchvision, ...
        error = missing_package_error(exc, f"model {name!r}: its processor")
        if error is None:
            raise
        raise error from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise CtxcError(
            f"model {name!r} has no processor in {folder} (no image processor config): save the "
            "model's processor there (processor.save_pretrained)"
        ) from exc
    if getattr(processor, "image_processor", None) is None:
        raise CtxcError(
            f"model {name!r} has no image processor in {folder} "
            "(save the model's processor there: processor.save_pretrained)"
        )
    return processor


def untouched_modules(model: torch.nn.Module, read: set[str]) -> list[tuple[str, int]]:
    """Top modules holding parameters that the text path never reads (vision tower, projector).

    Args:
        model: the model.
        read: the names of the parameters its text-path graph reads (the ``param_of`` names
            of placeholders that have users: ``torch.export`` lifts unread ones too).

    Returns:
        ``(module path, parameter count)`` per module, in the model's order; empty for a text
        model. A module is named at the first level where it holds no read parameter.
    """
    # A tied weight (Gemma's embedding and head) has several names: read under any is read.
    names: dict[int, list[str]] = {}
    sizes: dict[int, int] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        sizes[id(p)] = p.numel()
    unread = [(ns[0], sizes[i]) for i, ns in names.items() if not any(n in read for n in ns)]
    groups: dict[str, int] = {}
    for name, count in unread:
        parts = name.split(".")
        for end in range(1, len(parts) + 1):
            prefix = ".".join(parts[:end])
            if not any(r == prefix or r.startswith(prefix + ".") for r in read):
                groups[prefix] = groups.get(prefix, 0) + count
                break
    return list(groups.items())
