"""Image contexts: reading image files, and the model's processor layout of images and text.

The context is what the model's own processor makes of the images and the text: each image
becomes the processor's image tokens (Gemma 3: ``<start_of_image>``, its soft tokens,
``<end_of_image>``; LLaVA: ``<image>`` repeated), in place. Where the images go: at each
occurrence of the processor's placeholder (``processor.image_token``) in the context text, in
order; when the text has none, all images come first, then the text. The query is text,
``tokenizer(query, add_special_tokens=False)`` as for text contexts (DESIGN.md, CLI contract);
without one, the query is the context's last token, which must not be an image token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ctxc.core.errors import CtxcError, missing_package_error

__all__ = [
    "ImageContext",
    "chat_image_context",
    "encode_image_context",
    "prefill_inputs",
    "read_images",
]


@dataclass(frozen=True)
class ImageContext:
    """An image context, tokenised, with the multimodal forward's inputs over context + query.

    Attributes:
        context_ids: the processor's ids of the context, image tokens included.
        query_ids: the query's ids (text).
        inputs: keyword inputs of the model's multimodal forward over context + query:
            ``input_ids`` [1, n], ``pixel_values``, ``attention_mask`` and the processor's other
            per-token tensors (``token_type_ids`` [1, n], ...), extended over the query.
        images: ``name sha256`` of each image, in order (for the report).
        image_tokens: how many context positions are image tokens.
    """

    context_ids: list[int]
    query_ids: list[int]
    inputs: dict[str, torch.Tensor]
    images: tuple[str, ...]
    image_tokens: int


def read_images(sources) -> list:
    """Open PNG/JPEG (any format Pillow reads) files as RGB images; PIL images pass through.

    Args:
        sources: paths, or ``PIL.Image.Image`` objects.

    Returns:
        the images, decoded (a truncated file fails here, not in the processor).

    Raises:
        CtxcError: no image given, a missing file, or a file that is no image.
    """
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise CtxcError("images need Pillow: pip install 'ctxc[vision]'") from None

    images = []
    for source in sources:
        if isinstance(source, Image.Image):
            images.append(source.convert("RGB"))
            continue
        path = Path(source)
        if not path.exists():
            raise CtxcError(f"image file not found: {path}")
        if not path.is_file():
            raise CtxcError(f"image path is not a file: {path}")
        try:
            with Image.open(path) as img:
                img.load()
                images.append(img.convert("RGB"))
        except UnidentifiedImageError:
            raise CtxcError(f"not an image file (PNG, JPEG, ...): {path}") from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise CtxcError(f"cannot read image {path}: {exc}") from None
    if not images:
        raise CtxcError("no image given")
    return images


def _names(sources, images) -> tuple[str, ...]:
    names = []
    for source, img in zip(sources, images, strict=True):
        digest = hashlib.sha256(img.tobytes()).hexdigest()[:16]
        name = Path(source).name if isinstance(source, str | Path) else "image"
        names.append(f"{name} {digest}")
    return tuple(names)


def _layout(text: str, placeholder: str, count: int) -> str:
    """The processor's text: placeholders where the text has them, else all images first."""
    found = text.count(placeholder) if placeholder else 0
    if found == 0:
        lead = placeholder * count
        return f"{lead}\n{text}" if text.strip() else lead
    if found != count:
        raise CtxcError(
            f"the context has {found} image placeholder(s) {placeholder!r} for {count} image(s)"
        )
    return text


def encode_image_context(
    model: torch.nn.Module, processor, context: str | None, sources, query: str | None
) -> ImageContext:
    """Tokenise an image context with the model's processor, and the query with its tokenizer.

    Args:
        model: the vision-language model (its config's ``image_token_id``, its device).
        processor: the model's processor (:func:`ctxc.models.vlm.load_processor`).
        context: the text around the images; ``None`` or empty for an image-only context.
        sources: image paths or PIL images (:func:`read_images`).
        query: the query text, or ``None`` for the context's last token.

    Returns:
        the :class:`ImageContext`.

    Raises:
        CtxcError: a bad image, placeholders that do not match the images, an empty query, a
            context that ends in an image token without a query, or a processor failure.
    """
    images = read_images(sources)
    placeholder = str(getattr(processor, "image_token", "") or "")
    text = _layout(context or "", placeholder, len(images))
    try:
        enc = processor(text=text, images=images, return_tensors="pt")
    except ImportError as exc:  # a library the processor imports on first use
        error = missing_package_error(exc, "the model's processor")
        if error is None:
            raise
        raise error from None
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CtxcError(f"the processor rejected the image context: {first}") from None
    ids = enc["input_ids"]  # [1, n]
    image_id = getattr(model.config, "image_token_id", None)
    is_image = (
        ids[0] == image_id if image_id is not None else torch.zeros_like(ids[0], dtype=torch.bool)
    )
    ctx_ids = [int(i) for i in ids[0]]
    if query is None:
        if bool(is_image[-1]) or len(ctx_ids) < 2:
            raise CtxcError().naming("the context ends with an image: give a query ({query})")
        ctx_ids, q_ids = ctx_ids[:-1], ctx_ids[-1:]
        extended = dict(enc)
    else:
        if not query.strip():
            raise CtxcError("the query is empty")
        tokenizer = getattr(processor, "tokenizer", processor)
        q_ids = [int(i) for i in tokenizer(query, add_special_tokens=False).input_ids]
        if not q_ids:
            raise CtxcError("the query tokenizes to no tokens")
        extended = _extend(dict(enc), q_ids)
    inputs = _on_model(model, extended)
    return ImageContext(ctx_ids, q_ids, inputs, _names(sources, images), int(is_image.sum()))


def _on_model(model: torch.nn.Module, enc: dict) -> dict[str, torch.Tensor]:
    """The processor's tensors on the model's device, floating ones in its dtype."""
    device = next(model.parameters()).device
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    return {
        k: v.to(device, dtype if v.is_floating_point() else None)
        for k, v in enc.items()
        if isinstance(v, torch.Tensor)
    }


def chat_image_context(model: torch.nn.Module, processor, split, sources) -> ImageContext:
    """An image chat context: the processor's inputs over a conversation that
    :func:`ctxc.core.chat.split_chat` split, its images in the context's turns.

    Args:
        model: the vision-language model.
        processor: its processor (the one the split was rendered and tokenised with).
        split: the :class:`~ctxc.core.chat.ChatSplit`.
        sources: the images, in the order of the messages' image parts.

    Raises:
        CtxcError: the processor's ids differ from the split's, or an image token falls in the
            query turn.
    """
    images = read_images(sources)
    try:
        enc = processor(
            text=split.context_text + split.query_text,
            images=images,
            add_special_tokens=False,  # the template wrote its own BOS
            return_tensors="pt",
        )
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CtxcError(f"the processor rejected the chat's images: {first}") from None
    ids = [int(i) for i in enc["input_ids"][0]]
    if ids != split.context_ids + split.query_ids:
        raise CtxcError("the processor's ids for the conversation differ from its chat split")
    image_id = getattr(model.config, "image_token_id", None)
    is_image = torch.tensor([i == image_id for i in ids], dtype=torch.bool)
    if bool(is_image[len(split.context_ids) :].any()):
        raise CtxcError("the query turn holds image tokens: images go in the context's turns")
    inputs = _on_model(model, dict(enc))
    return ImageContext(
        split.context_ids, split.query_ids, inputs, _names(sources, images), int(is_image.sum())
    )


def _extend(enc: dict, q_ids: list[int]) -> dict:
    """The processor's outputs over context + query: per-token tensors get the query's values.

    ``input_ids`` gets the query ids, ``attention_mask`` ones, and every other [1, n] tensor
    (``token_type_ids``: 0 is text) zeros; the image tensors are left as they are.
    """
    ids = enc["input_ids"]
    q = torch.tensor([q_ids], dtype=ids.dtype)  # [1, k]
    out = {}
    for key, value in enc.items():
        if not isinstance(value, torch.Tensor) or value.shape[:2] != ids.shape:
            out[key] = value
        elif key == "input_ids":
            out[key] = torch.cat([value, q], dim=1)
        else:
            fill = 1 if key == "attention_mask" else 0
            out[key] = torch.cat([value, torch.full_like(q, fill, dtype=value.dtype)], dim=1)
    return out


def prefill_inputs(image: ImageContext) -> dict[str, torch.Tensor]:
    """The multimodal forward's inputs over all of context + query but the last token.

    ``ctxc generate`` prefills the full-context baseline's cache with these; its decode steps
    are text. Per-token tensors ([1, n]) lose their last position; the image tensors stay.
    """
    ids = image.inputs["input_ids"]
    return {k: v[:, :-1] if v.shape[:2] == ids.shape else v for k, v in image.inputs.items()}
