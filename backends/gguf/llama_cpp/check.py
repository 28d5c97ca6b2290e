"""The GGUF emitters' llama.cpp check: what the artefact is run against, and when it is skipped.

``model.gguf`` is run against the unpatched model written as a GGUF of the same type;
``lora.gguf`` on that unpatched GGUF, and also on the GGUF the model came from when there is
one (the bundled Gemma 3 270M's Q4_K_M file: what llama.cpp users run), each against llama.cpp's
own full-context run on the same base (:mod:`llama_cpp_run`).
"""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ctxc.backends.gguf.llama_cpp.run import LlamaCppFigures, llama_cpp_check, llama_cpp_unavailable
from ctxc.backends.reference import torch_logits
from ctxc.core.vocabulary import GGUF_F32
from ctxc.models.load import source_gguf
from ctxc.patch import Patch

__all__ = ["LlamaCppRuns", "run_in_llama_cpp"]


@dataclass(frozen=True)
class LlamaCppRuns:
    """What the llama.cpp check of one GGUF artefact measured, or why it did not run.

    Attributes:
        same_type: the artefact on the unpatched GGUF of its own type (checked), or None.
        source: ``lora.gguf`` on the GGUF file the model came from (a quantized one: reported,
            not checked), or None.
        skipped: why llama.cpp did not run, or None.
    """

    same_type: LlamaCppFigures | None = None
    source: LlamaCppFigures | None = None
    skipped: str | None = None


def run_in_llama_cpp(
    model: torch.nn.Module,
    patch: Patch,
    *,
    what: str,
    full: torch.Tensor,
    tokenizer=None,
    gguf_type: str = GGUF_F32,
    patched: Path | None = None,
    lora: Path | None = None,
    own: float = 0.0,
    transformers_patched: torch.Tensor | None = None,
) -> LlamaCppRuns:
    """Run ``patched`` (a model GGUF) or ``lora`` (a LoRA GGUF) in llama.cpp, when it loads.

    ``model`` must be unpatched: its weights are written as the base GGUF (into a temporary
    folder, removed after) and its query-alone logits are the floor's Transformers side.

    Args:
        model: the model the patch was computed on, unpatched.
        patch: the patch (its context and query ids are fed).
        what: the artefact's file name, for messages.
        full: the unpatched torch model's logits on context + query, query rows [k, vocab].
        tokenizer: the tokenizer (needed to write the base unless the model came from a GGUF).
        gguf_type: the artefact's type; the base is written in it.
        patched: the patched model GGUF, or None with ``lora``.
        lora: the LoRA GGUF, or None with ``patched``.
        own: the artefact's own distance from the full-context run in Transformers.
        transformers_patched: ctxc's patched model fed the query [k, vocab]: the artefact is
            held to it too (:func:`llama_cpp_check`).

    Returns:
        the :class:`LlamaCppRuns`.

    Raises:
        CtxcError: llama.cpp cannot run a file, or the artefact fails the bound.
    """
    from ctxc.backends.gguf.write import write_gguf

    reason = llama_cpp_unavailable()
    source = source_gguf(model)
    if reason is None and tokenizer is None and source is None:
        reason = "no tokenizer to write the unpatched GGUF with"
    if reason is not None:
        return LlamaCppRuns(skipped=reason)
    ids = (list(patch.meta.context_ids), list(patch.meta.query_ids))
    (alone,) = torch_logits(model, [torch.tensor([ids[1]])])
    check = functools.partial(
        llama_cpp_check,
        ids=ids,
        transformers_query=alone,
        transformers_full=full,
        own=own,
        transformers_patched=transformers_patched,
        baked=patch.meta.baked,
    )
    with tempfile.TemporaryDirectory(prefix="ctxc-gguf-base-") as tmp:
        base = Path(tmp) / "base.gguf"
        write_gguf(model, tokenizer, base, gguf_type)
        same = check(
            what,
            base,
            patched=patched,
            lora=lora,
            base_name=f"the unpatched model as a {gguf_type} GGUF",
        )
    quantized = None
    if lora is not None and source is not None:
        quantized = check(what, source, lora=lora, base_name=source.name, enforce=False)
    return LlamaCppRuns(same_type=same, source=quantized)
