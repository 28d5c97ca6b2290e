"""``ctxc compile``: one context into patch.safetensors, report.json and the asked artefacts.

:func:`compile_into` is the single compile every context goes through, alone or one line of a
``--contexts`` run (``compiler/cli/batch.py``). No torch import at module level.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from ctxc.cli.images import image_options, processor_of
from ctxc.cli.options import (
    DEVICE,
    DEVICE_MAP,
    FORCE,
    MAX_MEMORY,
    MODEL,
    DType,
    GgufType,
    Update,
    emit_help,
    placement_for,
)
from ctxc.cli.output import output_folder
from ctxc.cli.progress import VERBOSE, say, stage, stage_progress
from ctxc.cli.support import load, parse_emit, read_context, written
from ctxc.core.checks import ArtefactError
from ctxc.core.errors import CtxcError
from ctxc.core.interrupts import pause_point
from ctxc.core.options import CompileOptions

if TYPE_CHECKING:
    from ctxc.models.devices import Placement

__all__ = ["CompileJob", "compile_cmd", "compile_into"]


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
    gguf_type: str = "F32"
    images: tuple = ()
    placement: Placement | None = None


def compile_cmd(
    context: Path = typer.Option(None, "--context", help="UTF-8 text file with the context."),
    contexts: Path = typer.Option(
        None, "--contexts", help="JSON Lines: one {context, query?, name?} per line."
    ),
    model: str | None = MODEL,
    query: str = typer.Option(None, "--query", help="Query text (default: last context token)."),
    out_dir: Path = typer.Option(Path("ctxc-out"), "--out", help="Output folder."),
    update: Update = typer.Option("stable", "--update", help="Update rule."),
    dtype: DType = typer.Option("float32", "--dtype", help="Model dtype."),
    emit: str = typer.Option("torch", "--emit", help=emit_help("Comma list of artefacts")),
    gguf_type: GgufType = typer.Option("F32", "--gguf-type", help="GGUF matrix type."),
    start_layer: int = typer.Option(0, "--start-layer", help="First block to patch."),
    skip_unpatchable: bool = typer.Option(
        False, "--skip-unpatchable", help="Patch the other blocks when some admit no patch."
    ),
    device: str = DEVICE,
    device_map: str = DEVICE_MAP,
    max_memory: str = MAX_MEMORY,
    force: bool = FORCE,
    image: list[Path] = typer.Option(
        None, "--image", metavar="<path>", help="Image file (PNG, JPEG) in the context; repeat."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="With --contexts: keep the lines an earlier run wrote in --out."
    ),
    verbose: bool = VERBOSE,
) -> None:
    """Compile a context into a patch; write patch.safetensors, report.json and artefacts."""
    from ctxc.cli.batch import compile_batch  # it imports this module

    if image and contexts is not None:
        raise CtxcError("--image applies to --context (or to no context: the images alone)")
    if context is None and contexts is None and not image:
        raise CtxcError("missing option '--context' (or '--contexts' for a JSON Lines file)")
    if context is not None and contexts is not None:
        raise CtxcError("--context and --contexts are mutually exclusive: give one")
    kinds = parse_emit(emit)
    where = placement_for(device, device_map, max_memory, kinds)
    compiling = CompileOptions(update, start_layer, skip_unpatchable)  # validated here, once
    opts = CompileJob(compiling, kinds, gguf_type, placement=where)
    if contexts is not None:
        if query is not None:
            raise CtxcError("--query applies to --context; give each query in the JSON lines")
        rc = compile_batch(contexts, out_dir, model, dtype, force, opts, resume)
        raise typer.Exit(rc)
    if resume:
        raise CtxcError("--resume applies to --contexts")
    text = read_context(context) if context is not None else ""  # the query: the library's
    if image:
        opts = image_options(opts, image)  # every image read now, before the model loads
    with output_folder(out_dir, force, "compile") as tmp:
        net, tokenizer = load(model, dtype, where)
        if image:
            tokenizer = processor_of(net, model)
        with stage_progress("compiling", "solving") as (on_stage, on_block):
            report, figures = compile_into(
                net, tokenizer, tmp, text, query, opts, on_stage=on_stage, on_block=on_block
            )
    say(report.summary(tokenizer.decode if hasattr(tokenizer, "decode") else None))
    for f in figures.values():
        say(f.summary())
    say(f"wrote {out_dir}/ ({', '.join(written(opts.kinds))})")


def compile_into(net, tokenizer, tmp: Path, text: str, query, job: CompileJob, **hooks):
    """Compile one context and write patch.safetensors, report.json and artefacts into ``tmp``.

    Args:
        net, tokenizer: the loaded model (a processor for an image context).
        tmp: the staging folder to write into.
        text: the context; ``query``: the query text, or None (the context's last token).
        job: the run's options and artefacts.
        hooks: ``on_stage``/``on_block`` for :func:`ctxc.compile`.

    Returns:
        (the report as written, the emitted artefacts' figures but the torch model folder's:
        its reload is the report's ``emitted`` figure).

    Raises:
        ArtefactError: an artefact failed; ``tmp`` then holds the patch, the artefacts that
            passed and report.json with the failure under ``"failed"``.
    """
    import ctxc
    from ctxc.backends import emit_checked, precheck

    precheck(net, job.kinds)
    result = ctxc.compile(
        net,
        tokenizer,
        context=text,
        query=query,
        images=list(job.images) or None,
        # With model/ written, its reload measures the same weights at the same addresses
        # (README: 3.1e-6 both ways): the in-memory run would be a second forward pass and a
        # second materialisation of every patched weight for the same figure.
        verify="torch" not in job.kinds,
        options=job.compile,
        **hooks,
    )
    result.patch.save(tmp / "patch.safetensors")
    pause_point("writing")
    try:
        figures = emit_checked(
            net,
            result.patch,
            tmp,
            job.kinds,
            full=result.full_logits,
            on_stage=stage,
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
    from ctxc.core.report import write_report

    figures = dict(figures)
    folder = figures.pop("torch", None)  # model/, reloaded: what a user loads
    if folder is not None:
        report = dataclasses.replace(report, emitted=folder.reloaded)
        measured = folder.measured_on
    elif "torch" in kinds:
        measured = "the solver's pass (model/ failed its check)"
    else:
        measured = "the patched model in memory (no model/ written)"
    write_report(tmp, {**report.to_dict(), "emitted_measured_on": measured}, figures, failed)
    return report, figures
