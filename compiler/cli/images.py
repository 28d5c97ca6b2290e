"""``--image`` of ``ctxc compile`` and ``ctxc generate``: checks before the model loads, the
processor after. No torch import at module level (``ctxc --help`` stays fast).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

__all__ = ["generate_inputs", "image_options", "processor_of", "refuse_image_patch"]


def image_options(opts, paths: list[Path]):
    """``opts`` with the image paths, every image read and decoded first.

    Raises:
        CtxcError: a missing file or a file that is no image (one line naming it), before
            the model loads and before any output folder exists.
    """
    from ctxc.models.images import read_images

    read_images(paths)
    return dataclasses.replace(opts, images=tuple(str(p) for p in paths))


def processor_of(net, spec: str | None):
    """The loaded model's processor, or a one-line CtxcError (text-only model, no processor)."""
    from ctxc.models.load import DEFAULT_MODEL
    from ctxc.models.vlm import load_processor

    return load_processor(net, spec or DEFAULT_MODEL)


def generate_inputs(net, spec: str | None, text: str, paths: list[Path]) -> tuple[list, dict]:
    """The context ids of an image context and the multimodal prefill of ``ctxc generate``.

    Args:
        net: the vision-language model.
        spec: the ``--model`` value, for messages.
        text: the context text ("" for the images alone).
        paths: the image files.

    Returns:
        ``(context ids, prefill inputs)``: the prefill is the multimodal forward's keyword
        inputs over every context token but the last (the first query of the protocol).
    """
    from ctxc.models.images import encode_image_context, prefill_inputs

    image = encode_image_context(net, processor_of(net, spec), text, paths, None)
    return image.context_ids + image.query_ids, prefill_inputs(image)


def refuse_image_patch(net, patch) -> None:
    """Refuse ``ctxc export`` of a patch compiled from an image context.

    The patch keeps the context's token ids, not its pixels: export would check the artefact
    against the model fed those ids as text, which is not the context the patch reproduces.

    Raises:
        CtxcError: the patch's context holds the model's image tokens.
    """
    from ctxc.core.errors import CtxcError

    image_id = getattr(net.config, "image_token_id", None)
    count = sum(1 for i in patch.meta.context_ids if i == image_id) if image_id is not None else 0
    if count:
        raise CtxcError(
            f"this patch was compiled from an image context ({count} image tokens); export has "
            "no images to check it against: emit the artefacts with `ctxc compile --image ... "
            "--emit torch,onnx,peft`"
        )
