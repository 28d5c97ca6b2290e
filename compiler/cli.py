"""The ``ctxc`` command line (DESIGN.md, CLI contract).

Errors a user can cause print one line, ``ctxc: error: ...``, and exit 2, with no traceback and
no partly written output folder (outputs go to a temporary folder that is renamed at the end).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from enum import Enum
from pathlib import Path

import click
import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ctxc.errors import CtxcError

__all__ = ["app", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Compile a context into exact low-rank patches of a transformer's MLP weights.",
)
err = Console(stderr=True)
out = Console()

EMITTERS = ("torch", "onnx", "peft")


class Update(str, Enum):
    standard = "standard"
    stable = "stable"
    output = "output"


class DType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Format(str, Enum):
    text = "text"
    json = "json"
    html = "html"


def read_context(path: Path) -> str:
    """The UTF-8 text of ``path``; a CtxcError for a missing, unreadable, empty or binary file."""
    if not path.exists():
        raise CtxcError(f"context file not found: {path}")
    if not path.is_file():
        raise CtxcError(f"context path is not a file: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CtxcError(f"context file is not UTF-8 text: {path} (byte {exc.start})") from None
    except OSError as exc:
        raise CtxcError(f"cannot read context file {path}: {exc.strerror}") from None
    if not text.strip():
        raise CtxcError(f"context file is empty: {path}")
    return text


def _parse_emit(emit: str, flag: str = "--emit") -> list[str]:
    kinds = [k.strip() for k in emit.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in EMITTERS]
    if unknown:
        raise CtxcError(
            f"unknown {flag} value {unknown[0]!r}; expected one of {', '.join(EMITTERS)}"
        )
    # Fail before loading a model when an optional backend is not installed.
    if "onnx" in kinds:
        from ctxc.backends.onnx_model import require_onnx

        require_onnx()
    if "peft" in kinds:
        from ctxc.backends.peft_adapter import require_peft

        require_peft()
    return kinds


def _emit_checked(
    net, patch, tmp: Path, kinds: list[str], patchable: bool = False, full=None
) -> dict:
    """Write the ONNX and PEFT artefacts of ``kinds`` into ``tmp``; their figures by kind.

    Each emitter checks its artefact against the torch patched model and raises a CtxcError
    when the check fails, which removes the staging folder. ``full``: the full-context logits
    at the query positions when the caller has them (``ctxc compile`` does).
    """
    figures: dict = {}
    if "onnx" not in kinds and "peft" not in kinds:
        return figures
    if full is None:  # ctxc export: one full pass, shared by both emitters
        from ctxc.backends.verify import reference_logits

        full = reference_logits(net, patch)
    if "onnx" in kinds:
        if patchable:
            from ctxc.backends.onnx_patchable import emit_onnx_patchable as emit_onnx
        else:
            from ctxc.backends.onnx_model import emit_onnx
        with err.status("exporting model.onnx and checking it with onnxruntime"):
            _, onnx_figures = emit_onnx(net, patch, tmp, full=full)
        figures["onnx"] = onnx_figures
    if "peft" in kinds:
        from ctxc.backends.peft_adapter import emit_peft

        with err.status("writing the PEFT adapter and checking it"):
            _, peft_figures = emit_peft(net, patch, tmp, full=full)
        figures["peft"] = peft_figures
    return figures


def _check_out(path: Path, force: bool) -> None:
    if path.exists() and not path.is_dir():
        raise CtxcError(f"output path exists and is not a folder: {path}")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise CtxcError(f"output folder {path} is not empty (use --force to replace it)")


@contextmanager
def _staging(final: Path):
    """A temporary folder beside ``final``, renamed to it on success, removed on failure."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def _progress() -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )


def _load(model: str | None, dtype: str):
    import ctxc

    with err.status(f"loading {model or ctxc.models.DEFAULT_MODEL} ({dtype})"):
        return ctxc.load_model(model, dtype)


@app.command("compile")
def compile_cmd(
    context: Path = typer.Option(..., "--context", help="UTF-8 text file with the context."),
    model: str = typer.Option(None, "--model", help="Alias, model folder or .gguf file."),
    query: str = typer.Option(None, "--query", help="Query text (default: last context token)."),
    out_dir: Path = typer.Option(Path("ctxc-out"), "--out", help="Output folder."),
    update: Update = typer.Option(Update.stable, "--update", help="Update rule."),
    dtype: DType = typer.Option(DType.float32, "--dtype", help="Model dtype."),
    emit: str = typer.Option(
        "torch", "--emit", help="Comma list of artefacts: torch (model/), onnx, peft (adapter/)."
    ),
    start_layer: int = typer.Option(0, "--start-layer", help="First block to patch."),
    skip_unpatchable: bool = typer.Option(
        False, "--skip-unpatchable", help="Patch the other blocks when some admit no patch."
    ),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output folder."),
) -> None:
    """Compile a context into a patch; write patch.safetensors, report.json and artefacts."""
    import ctxc
    from ctxc.backends.torch_model import emit_torch

    text = read_context(context)
    kinds = _parse_emit(emit)
    _check_out(out_dir, force)
    if query is not None and not query.strip():
        raise CtxcError("the query is empty")
    net, tokenizer = _load(model, dtype.value)
    with _progress() as progress:
        task = progress.add_task("compiling", total=None)

        def on_stage(name: str) -> None:
            progress.update(task, description=name)

        def on_block(done: int, total: int, path: str) -> None:
            progress.update(task, completed=done, total=total, description=f"solving {path}")

        result = ctxc.compile(
            net,
            tokenizer,
            context=text,
            query=query,
            update=update.value,
            start_layer=start_layer,
            skip_unpatchable=skip_unpatchable,
            on_stage=on_stage,
            on_block=on_block,
        )
    with _staging(out_dir) as tmp:
        result.patch.save(tmp / "patch.safetensors")
        if "torch" in kinds:
            with err.status("writing model/"):
                emit_torch(net, tokenizer, result.patch, tmp / "model")
        figures = _emit_checked(net, result.patch, tmp, kinds, full=result.full_logits)
        report = result.report.to_dict()
        report.update({kind: f.to_dict() for kind, f in figures.items()})
        (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    out.print(result.report.summary())
    for f in figures.values():
        out.print(f.summary(), highlight=False)
    written = {"torch": "model/", "onnx": "model.onnx", "peft": "adapter/"}
    names = ["patch.safetensors", "report.json", *(written[k] for k in kinds)]
    out.print(f"wrote {out_dir}/ ({', '.join(names)})")


@app.command("export")
def export_cmd(
    patch_file: Path = typer.Option(..., "--patch", help="patch.safetensors from ctxc compile."),
    model: str = typer.Option(None, "--model", help="The model the patch was computed on."),
    to: str = typer.Option(
        "torch", "--to", help="Artefact: torch (the model folder), onnx (model.onnx), peft."
    ),
    patchable: bool = typer.Option(
        False, "--patchable", help="ONNX with the patch factors as graph inputs."
    ),
    out_dir: Path = typer.Option(..., "--out", help="Output folder."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output folder."),
) -> None:
    """Emit an artefact from a saved patch."""
    import ctxc
    from ctxc.backends.torch_model import emit_torch

    kinds = _parse_emit(to, "--to")
    if patchable and "onnx" not in kinds:
        raise CtxcError("--patchable applies to --to onnx")
    _check_out(out_dir, force)
    patch = ctxc.Patch.load(patch_file)
    net, tokenizer = _load(model, patch.meta.dtype)
    patch.apply(net)  # checks the fingerprint
    patch.remove(net)
    with _staging(out_dir) as tmp:
        if "torch" in kinds:
            emit_torch(net, tokenizer, patch, tmp)
        figures = _emit_checked(net, patch, tmp, kinds, patchable)
        if figures:
            report = {"patch": str(patch_file), "model": patch.meta.model}
            report.update({kind: f.to_dict() for kind, f in figures.items()})
            (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    for f in figures.values():
        out.print(f.summary(), highlight=False)
    out.print(f"wrote {out_dir}/")


@app.command("inspect")
def inspect_cmd(
    model: str = typer.Option(None, "--model", help="Alias, model folder or .gguf file."),
    fmt: Format = typer.Option(
        Format.text, "--format", help="text, json, or html (a page with a diagram per shape)."
    ),
) -> None:
    """Report every residual MLP block: its shape, parts and roles, what ctxc patches per
    update rule, or why a block cannot be patched."""
    from ctxc.inspect_model import inspect_model

    net, _ = _load(model, "float32")
    info = inspect_model(net)
    if fmt is Format.text:
        out.print(info.to_text(), highlight=False, markup=False, soft_wrap=True)
    else:  # plain bytes on stdout: no console wrapping or markup in machine-read formats
        sys.stdout.write(info.to_json() if fmt is Format.json else info.to_html())
        sys.stdout.flush()


@app.command("generate")
def generate_cmd(
    context: Path = typer.Option(..., "--context", help="UTF-8 text file with the context."),
    model: str = typer.Option(None, "--model", help="Alias, model folder or .gguf file."),
    max_new_tokens: int = typer.Option(20, "--max-new-tokens", help="Steps to generate."),
    update: Update = typer.Option(Update.stable, "--update", help="Update rule."),
    dtype: DType = typer.Option(DType.float32, "--dtype", help="Model dtype."),
    out_dir: Path = typer.Option(Path("ctxc-generate"), "--out", help="Output folder."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output folder."),
) -> None:
    """The paper's protocol: recompile the patch at every token against greedy generation."""
    from ctxc.generate import generate
    from ctxc.generate_report import plot_steps, steps_table, write_json

    text = read_context(context)
    if max_new_tokens < 1:
        raise CtxcError("--max-new-tokens must be at least 1")
    _check_out(out_dir, force)
    net, tokenizer = _load(model, dtype.value)
    ids = list(tokenizer(text).input_ids)
    with _progress() as progress:
        task = progress.add_task("generating", total=max_new_tokens)
        result = generate(
            net,
            ids,
            max_new_tokens,
            update=update.value,
            on_step=lambda s: progress.update(task, completed=s.step + 1),
        )
    with _staging(out_dir) as tmp:
        tokens = [tokenizer.decode([s.baseline_token]) for s in result.steps]
        write_json(result, tmp / "generate.json", tokens)
        plot_steps(result, tmp / "generate.png")
    out.print(steps_table(result, tokenizer.decode))
    summary = result.to_dict()["summary"]
    out.print(
        f"top-1 match {summary['top1_match_rate']:.1%} over {summary['steps']} steps; "
        f"max |logit diff| {summary['max_abs_logit_diff']:.3g}; "
        f"mean step {result.timings['steps'] / max(1, len(result.steps)):.3f} s "
        f"(targets from {result.targets_from})"
    )
    out.print(f"wrote {out_dir}/ (generate.json, generate.png)")


def main(argv: list[str] | None = None) -> int:
    """Console entry point: runs the app, turns every user error into one line."""
    _quiet_libraries()
    try:
        app(args=argv, standalone_mode=False)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code or 0)
    except click.ClickException as exc:
        err.print(f"ctxc: error: {exc.format_message()}", highlight=False, soft_wrap=True)
        return 2
    except click.exceptions.Abort:
        err.print("ctxc: interrupted")
        return 130
    except CtxcError as exc:
        err.print(f"ctxc: error: {exc}", highlight=False, soft_wrap=True, markup=False)
        return 2
    except KeyboardInterrupt:
        err.print("ctxc: interrupted")
        return 130
    except Exception as exc:
        if os.environ.get("CTXC_DEBUG"):
            raise
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = lines[0] if lines else ""
        err.print(
            f"ctxc: internal error: {type(exc).__name__}: {first} (set CTXC_DEBUG=1 for details)",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
        return 1
    return 0


def _quiet_libraries() -> None:
    import logging
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    # The ONNX exporter logs a warning per optional op library it does not find (torchvision).
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


if __name__ == "__main__":
    sys.exit(main())
