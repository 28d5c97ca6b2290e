"""One compile into a staging folder: the single compile every context goes through, alone
(``ctxc compile``) or one line of a batch run. No torch import at module level."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ctxc.core.checks import ArtefactError
from ctxc.core.interrupts import pause_point
from ctxc.core.options import CompileOptions
from ctxc.core.vocabulary import GGUF_F32, PATCH_FILE

if TYPE_CHECKING:
    from ctxc.models.devices import Placement

__all__ = ["CompileJob", "compile_into"]


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """What every context of a run is compiled with and into.

    Attributes:
        compile: the library's options, validated once when the command started.
        kinds: the artefacts to emit (``--emit``, checked).
        gguf_type: the GGUF matrix type.
        images: the image files of an image context (``ctxc compile --image``), read already.
        placement: a :class:`~ctxc.models.devices.Placement`: where the model is loaded.
    """

    compile: CompileOptions
    kinds: list[str]
    gguf_type: str = GGUF_F32
    images: tuple = ()
    placement: Placement | None = None


def compile_into(
    net,
    tokenizer,
    tmp: Path,
    text: str | None,
    query,
    job: CompileJob,
    messages=None,
    on_emit: Callable[[str], None] | None = None,
    **hooks,
):
    """Compile one context and write patch.safetensors, report.json and artefacts into ``tmp``.

    Args:
        net, tokenizer: the loaded model (a processor for an image context).
        tmp: the staging folder to write into.
        text: the context; ``query``: the query text, or None (the context's last token).
        job: the run's options and artefacts.
        messages: a chat context's turns instead of ``text`` (``ctxc.compile(messages=...)``):
            ``query`` is then the next user message.
        on_emit: told each artefact's status line as it is written and checked, or None.
        hooks: ``on_stage``/``on_block`` for :func:`ctxc.compile`.

    Returns:
        (the report as written, the emitted artefacts' figures but the torch model folder's:
        its reload is the report's ``emitted`` figure).

    Raises:
        ArtefactError: an artefact failed; ``tmp`` then holds the patch, the artefacts that
            passed and report.json with the failure under ``"failed"``.
    """
    from ctxc.backends import emit_checked, emitted_by, precheck
    from ctxc.pipeline import compile as compile_context

    precheck(net, job.kinds)
    result = compile_context(
        net,
        tokenizer,
        context=text,
        query=query,
        images=list(job.images) or None,
        messages=messages,
        # With model/ written, its reload measures the same weights at the same alignment
        # (compiler/runs/patched_forward.py): the in-memory run would be a second forward pass
        # and a second materialisation of every patched weight for the same figure.
        verify=emitted_by(job.kinds) is None,
        options=job.compile,
        **hooks,
    )
    result.patch.save(tmp / PATCH_FILE)
    pause_point("writing")
    try:
        figures = emit_checked(
            net,
            result.patch,
            tmp,
            job.kinds,
            full=result.full_logits,
            on_stage=on_emit,
            tokenizer=tokenizer,
            gguf_type=job.gguf_type,
            baked=result.patched_logits,
        )
    except ArtefactError as exc:
        _write_report(tmp, result.report, job.kinds, exc.passed, exc)
        raise
    return _write_report(tmp, result.report, job.kinds, figures)


def _write_report(tmp: Path, report, kinds: list[str], figures: dict, failed=None) -> tuple:
    """report.json: the compile's figures, ``emitted`` from model/ reloaded when it passed, the
    other artefacts' figures and, when one failed, the failure.

    Returns:
        (the report as written, the figures but torch's).
    """
    from ctxc.backends import emitted_by
    from ctxc.core.report import write_report

    figures = dict(figures)
    kind = emitted_by(kinds)
    folder = figures.pop(kind, None) if kind else None  # model/, reloaded: what a user loads
    if folder is not None:
        report = dataclasses.replace(report, emitted=folder.reloaded)
        measured = folder.measured_on
    elif kind is not None:
        measured = "the solver's pass (model/ failed its check)"
    else:
        measured = "the patched model in memory (no model/ written)"
    write_report(tmp, {**report.to_dict(), "emitted_measured_on": measured}, figures, failed)
    return report, figures
