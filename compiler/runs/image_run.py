"""The full run of an image context: the model's own multimodal forward, as a graph.

The solver needs, at the query positions, each language-model block's MLP input and output when
the model is fed the images and the text (MATH.md 3). For text these come from the traced graph;
here the images enter before the language model (vision tower, projector, the image features
merged into the embeddings, and for Gemma 3 a bidirectional mask over image tokens built from
``token_type_ids``). So the model's own multimodal forward runs once, eagerly, and the arguments
its language model (the decoder: the module above every block that takes ``inputs_embeds``)
receives are captured: the embeddings with the image features in place and the masks it built.
Then the model's text path is exported for that length with those arguments substituted at the
decoder by a forward pre-hook: the embeddings are the graph's input (so the locator sees the
residual stream flow from it, as from ``input_ids``), the other captured tensors (masks) become
constants of the graph, and the model's own ids are zeros that it never uses. That graph
holds the language model only: its blocks are located as for text and correspond to the text
graph's blocks by path. The vision tower and projector never enter a graph, so no patch touches
them; the image acts on the query through attention in the language model.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from ctxc.core.errors import CtxcError
from ctxc.frontend.trace import WRAPPED, TracedModel, no_cache, trace
from ctxc.passes.locate.block_map import BlockMap
from ctxc.passes.locate.locate_blocks import locate_blocks
from ctxc.runs.plain_attention import recording

__all__ = ["MultimodalRun", "decoder_path", "image_figures", "multimodal_full_graph"]


@dataclass(frozen=True)
class MultimodalRun:
    """The full run's graph for one image context.

    Attributes:
        traced: the text path exported with the captured decoder arguments substituted; its
            one input is ``inputs_embeds`` [1, n, d].
        blocks: its block map (the language model's blocks).
        inputs_embeds: the captured embeddings, images in place [1, n, d]: the graph's input.
        reference: the model's own eager multimodal forward at the query positions,
            float32 [k, vocab]: what the graph's full run must reproduce.
        decoder: module path of the language model whose arguments were captured.
        attention: the language model's attention calls in that forward, in order
            (``compiler/runs/plain_attention.py``: the full run takes them when the runtime's
            attention differs from the graph's).
    """

    traced: TracedModel
    blocks: BlockMap
    inputs_embeds: torch.Tensor
    reference: torch.Tensor
    decoder: str
    attention: tuple = ()


def decoder_path(model: torch.nn.Module, blocks: BlockMap) -> str:
    """The module that runs every block and takes ``inputs_embeds``: the language model.

    Found from the block map: the deepest common ancestor of the blocks' module paths, walked up
    to the first module whose ``forward`` accepts ``inputs_embeds`` (never the model itself,
    whose forward is the one that merges the images).

    Raises:
        CtxcError: no such module (the model's language part cannot take merged embeddings).
    """
    paths = [b.path.split(".") for b in blocks.blocks]
    if not paths:
        raise CtxcError("no residual MLP block found in this model's language model")
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    for end in range(len(common), 0, -1):
        path = ".".join(common[:end])
        module = model.get_submodule(path)
        if "inputs_embeds" in inspect.signature(module.forward).parameters:
            return path
    raise CtxcError(
        "no module above the language model's blocks takes inputs_embeds "
        f"(blocks under {'.'.join(common) or 'the model'}): cannot feed it the image features"
    )


class _Substituted(torch.nn.Module):
    """``forward(inputs_embeds) -> logits``: the decoder gets the captured arguments, with
    ``inputs_embeds`` the input; the model itself is fed zeros as ids (its output is dropped)."""

    def __init__(self, model: torch.nn.Module, decoder: str, args: tuple, kwargs: dict) -> None:
        super().__init__()
        setattr(self, WRAPPED, model)
        self.decoder, self.captured = decoder, (args, kwargs)

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        model = getattr(self, WRAPPED)
        args, kwargs = self.captured
        ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        handle = model.get_submodule(self.decoder).register_forward_pre_hook(
            lambda _m, _a, _k: (args, {**kwargs, "inputs_embeds": inputs_embeds}),
            with_kwargs=True,
        )
        try:
            return model(input_ids=ids).logits
        finally:
            handle.remove()


def _capture(model: torch.nn.Module, decoder: str, inputs: dict) -> tuple:
    """Run the multimodal forward once; the decoder's (args, kwargs), the logits [1, n, V] and
    the decoder's attention calls."""
    seen: dict[str, tuple] = {}

    def hook(_module, args, kwargs):
        seen.setdefault("call", (args, dict(kwargs)))  # the first call: the full input

    handle = model.get_submodule(decoder).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with recording(model, decoder) as rec, no_cache(model), torch.no_grad():
            logits = model(**inputs).logits
    finally:
        handle.remove()
    if "call" not in seen:
        raise CtxcError(f"the multimodal forward never called the language model ({decoder})")
    args, kwargs = seen["call"]
    if not isinstance(kwargs.get("inputs_embeds"), torch.Tensor):
        raise CtxcError(f"the multimodal forward does not pass inputs_embeds to {decoder}")
    return args, kwargs, logits, tuple(rec.calls)


def multimodal_full_graph(
    model: torch.nn.Module, text_blocks: BlockMap, inputs: dict[str, torch.Tensor], k: int
) -> MultimodalRun:
    """Export the full run of an image context (see the module docstring).

    Args:
        model: the vision-language model, unpatched.
        text_blocks: the block map of its text path (the reduced run's graph).
        inputs: the multimodal forward's keyword inputs over context + query (``input_ids``
            [1, n], ``pixel_values``, masks, ...), on the model's device.
        k: the number of query tokens at the end.

    Returns:
        the :class:`MultimodalRun`. The model is left unmodified (hooks removed).

    Raises:
        CtxcError: no language model found above the blocks, the export failed, or its blocks
            do not correspond to the text graph's.
    """
    decoder = decoder_path(model, text_blocks)
    args, kwargs, logits, calls = _capture(model, decoder, inputs)
    embeds = kwargs.pop("inputs_embeds")  # [1, n, d]
    n = int(embeds.shape[1])
    wrapper = _Substituted(model, decoder, args, kwargs)
    traced = trace(model, n, (n, n), "static", wrapper=wrapper, example=embeds)
    blocks = locate_blocks(traced)
    want = [(b.path, b.output_control, len(b.inner)) for b in text_blocks.blocks]
    got = [(b.path, b.output_control, len(b.inner)) for b in blocks.blocks]
    if got != want:
        raise CtxcError(
            f"the multimodal full run finds other blocks than the text path ({len(got)}: "
            f"{got[:2]}... vs {len(want)}: {want[:2]}...): no correspondence"
        )
    reference = logits[0, -k:].float()  # [k, vocab]
    return MultimodalRun(traced, blocks, embeds, reference, decoder, calls)


def image_figures(image, run: MultimodalRun, full_logits: torch.Tensor) -> dict:
    """The report's ``images`` entry: what was compiled, and the full run's own check.

    Args:
        image: the :class:`~ctxc.models.images.ImageContext`.
        run: its :class:`MultimodalRun`.
        full_logits: the graph's full-run logits at the query positions [k, vocab], its head
            as the model's forward applies it (``FullRun.reference``).

    Returns:
        ``images`` (name and sha256 prefix of each), ``image_tokens``, ``language_model`` (the
        decoder's module path) and ``full_run_vs_model``: max |logit diff| between the graph's
        full run and the model's own eager multimodal forward (the reference is the latter).
    """
    diff = (full_logits.float() - run.reference.to(full_logits.device)).abs().max()
    return {
        "images": list(image.images),
        "image_tokens": image.image_tokens,
        "language_model": run.decoder,
        "full_run_export": run.traced.frontend,
        "full_run_vs_model": float(diff),
    }
