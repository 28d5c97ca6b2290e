"""``ctxc export``: the artefacts of a saved patch, each checked as a compile's are.

No torch import at module level (``ctxc --help`` stays fast).
"""

from __future__ import annotations

from pathlib import Path

import typer

from ctxc.cli.images import refuse_image_patch
from ctxc.cli.options import (
    DEVICE,
    DEVICE_MAP,
    FORCE,
    MAX_MEMORY,
    MODEL,
    GgufType,
    emit_help,
    placement_for,
)
from ctxc.cli.progress import VERBOSE, say, stage
from ctxc.cli.support import load, parse_emit, summaries
from ctxc.core.checks import ArtefactError
from ctxc.core.errors import CtxcError
from ctxc.core.interrupts import pause_point
from ctxc.core.vocabulary import GGUF_F32, PATCH_FILE
from ctxc.store.output import output_folder

__all__ = ["export_cmd"]


def export_cmd(
    patch_file: Path = typer.Option(
        ..., "--patch", help=f"{PATCH_FILE} from ctxc compile, or its folder."
    ),
    model: str | None = MODEL,
    to: str = typer.Option("torch", "--to", help=emit_help("Artefact (torch: the folder itself)")),
    gguf_type: GgufType = typer.Option(GGUF_F32, "--gguf-type", help="GGUF matrix type."),
    patchable: bool = typer.Option(
        False, "--patchable", help="ONNX with the patch factors as graph inputs."
    ),
    out_dir: Path = typer.Option(..., "--out", help="Output folder."),
    device: str = DEVICE,
    device_map: str = DEVICE_MAP,
    max_memory: str = MAX_MEMORY,
    force: bool = FORCE,
    verbose: bool = VERBOSE,
) -> None:
    """Emit an artefact from a saved patch."""
    from ctxc.patch import Patch

    kinds = parse_emit(to, "--to")
    if patchable:
        _check_patchable(kinds)
    where = placement_for(device, device_map, max_memory, kinds)
    patch = Patch.load(patch_file)  # validated: finite values, factor shapes, ranks
    _refuse_before_load(patch, kinds)
    with output_folder(out_dir, force, "export") as tmp:
        net, tokenizer = load(model, patch.meta.dtype, where)
        patch.check(net)  # fingerprint and shapes, without applying
        from ctxc.backends import emit_checked, precheck
        from ctxc.core.report import write_report

        refuse_image_patch(net, patch)
        precheck(net, kinds)
        pause_point("writing")
        report: dict = {"patch": str(patch_file.resolve()), "model": patch.meta.model}
        try:  # torch: the output folder is the model folder itself (folder="")
            figures = emit_checked(
                net,
                patch,
                tmp,
                kinds,
                patchable=patchable,
                on_stage=stage,
                tokenizer=tokenizer,
                gguf_type=gguf_type,
                folder="",
                bake_report=_bake_report(patch_file, patch),
            )
        except ArtefactError as exc:  # what passed is kept (cli_output: DIR.failed)
            if exc.passed:  # else nothing passed: nothing is kept
                write_report(tmp, report, exc.passed, exc)
            raise
        write_report(tmp, report, figures)
    for line in summaries(figures.values()):
        say(line)
    say(f"wrote {out_dir}/")


def _bake_report(patch_file: Path, patch) -> dict | None:
    """A baked patch's report (``report.json`` beside it: the bake's options and figures), for
    the artefacts that describe what they hold; None for a compile's patch or when unreadable."""
    import json

    from ctxc.core.report import REPORT_FILE

    if not patch.meta.baked:
        return None
    folder = patch_file if patch_file.is_dir() else patch_file.parent
    try:
        found = json.loads((folder / REPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _check_patchable(kinds: list[str]) -> None:
    """Refuse ``--patchable`` unless a kind asked declares a patchable variant
    (:attr:`Backend.patchable <ctxc.backends.base.Backend.patchable>`: ``onnx``).

    Raises:
        CtxcError: ``--patchable applies to --to onnx``, naming every kind that has one.
    """
    from ctxc.backends import BACKENDS

    if not any(BACKENDS[k].patchable for k in kinds):
        having = [name for name, b in BACKENDS.items() if b.patchable]
        raise CtxcError(f"--patchable applies to --to {' or '.join(having)}")


def _refuse_before_load(patch, kinds: list[str]) -> None:
    """What the patch alone tells: a LoRA kind (``lora``, ``gguf-lora``: linear weights only)
    of a patch with a norm-scale, bias or expert-bank delta is refused before the model loads.
    """
    from ctxc.backends import backend

    for kind in kinds:
        if backend(kind).rules is not None:
            from ctxc.backends.lora_pairs import refuse_unservable

            refuse_unservable(patch, f"--to {kind}")
