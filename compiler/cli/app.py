"""The ``ctxc`` command line (DESIGN.md, CLI contract).

Exit codes: 0 success (``ctxc`` alone prints the help, as ``--help`` does: asking for help is
no error); 2 a usage error or any other error a user can cause, printed as one line
``ctxc: error: ...``; 1 an internal error (a bug: one line, ``CTXC_DEBUG=1`` for the
traceback); 130 after Ctrl-C and 143 after SIGTERM (128 + the signal, as shells report it),
printed as ``ctxc: interrupted``. No error leaves a partly written output folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from ctxc._version import __version__
from ctxc.cli.bake import bake_cmd, eval_bake_cmd
from ctxc.cli.devices import DEVICE, DEVICE_MAP, MAX_MEMORY, placement_for
from ctxc.cli.images import generate_inputs, image_options, processor_of, refuse_image_patch
from ctxc.cli.options import (
    FORCE,
    MODEL,
    DType,
    Format,
    GgufType,
    Update,
    cli_message,
    emit_help,
)
from ctxc.cli.output import output_folder
from ctxc.cli.progress import (
    VERBOSE,
    command_trail,
    err,
    finish,
    progress,
    quiet_defaults,
    say,
    stage,
    stage_progress,
)
from ctxc.cli.support import load, parse_emit, read_context, written
from ctxc.cli.usage import hide_flag_types, is_click, usage_message
from ctxc.core.checks import ArtefactError
from ctxc.core.errors import CtxcError, missing_package_error
from ctxc.core.interrupts import install_handlers, pause_point, received

__all__ = ["app", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Compile a context into exact low-rank patches of a transformer's MLP weights.",
)
app.command("bake")(bake_cmd)  # thought patches (issue 13): compiler/cli/bake.py
app.command("eval-bake")(eval_bake_cmd)
hide_flag_types()  # --force, not --force <bool>, in --help


def _version(value: bool) -> None:
    if value:
        say(f"ctxc {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    verbose: bool = VERBOSE,
) -> None:
    """Compile a context into exact low-rank patches of a transformer's MLP weights."""


@app.command("compile")
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
    from ctxc.cli.batch import compile_batch
    from ctxc.cli.compile import CompileJob, compile_into
    from ctxc.core.options import CompileOptions

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
    text = read_context(context) if context is not None else ""
    if query == "":  # " " or "\n" is a query: real tokens (compiler/core/tokens.py)
        raise CtxcError("the query is empty")
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


@app.command("export")
def export_cmd(
    patch_file: Path = typer.Option(
        ..., "--patch", help="patch.safetensors from ctxc compile, or its folder."
    ),
    model: str | None = MODEL,
    to: str = typer.Option("torch", "--to", help=emit_help("Artefact (torch: the folder itself)")),
    gguf_type: GgufType = typer.Option("F32", "--gguf-type", help="GGUF matrix type."),
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
    if patchable and "onnx" not in kinds:
        raise CtxcError("--patchable applies to --to onnx")
    where = placement_for(device, device_map, max_memory, kinds)
    patch = Patch.load(patch_file)  # validated: finite values, factor shapes, ranks
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
            )
        except ArtefactError as exc:  # what passed is kept (cli_output: DIR.failed)
            if exc.passed:  # else nothing passed: nothing is kept
                write_report(tmp, report, exc.passed, exc)
            raise
        write_report(tmp, report, figures)
    for f in figures.values():
        say(f.summary())
    say(f"wrote {out_dir}/")


@app.command("inspect")
def inspect_cmd(
    model: str | None = MODEL,
    fmt: Format = typer.Option(
        "text", "--format", help="text, json, or html (a page with a diagram per shape)."
    ),
    device: str = DEVICE,
    device_map: str = DEVICE_MAP,
    max_memory: str = MAX_MEMORY,
    verbose: bool = VERBOSE,
) -> None:
    """Report every residual MLP block: its shape, parts and roles, what ctxc patches per
    update rule, or why a block cannot be patched."""
    net, _ = load(model, "float32", placement_for(device, device_map, max_memory))
    from ctxc.inspect.model import inspect_model
    from ctxc.inspect.render_html import render_html
    from ctxc.inspect.render_json import render_json
    from ctxc.inspect.render_text import render_text

    stage("tracing the model")
    info = inspect_model(net)
    if fmt == "text":
        say(render_text(info))
    else:  # plain bytes on stdout: no console wrapping or markup in machine-read formats
        finish()  # the progress trail ends before the bytes go out
        sys.stdout.write(render_json(info) if fmt == "json" else render_html(info))
        sys.stdout.flush()


@app.command("generate")
def generate_cmd(
    context: Path = typer.Option(None, "--context", help="UTF-8 text file with the context."),
    model: str | None = MODEL,
    max_new_tokens: int = typer.Option(20, "--max-new-tokens", help="Steps to generate."),
    update: Update = typer.Option("stable", "--update", help="Update rule."),
    dtype: DType = typer.Option("float32", "--dtype", help="Model dtype."),
    out_dir: Path = typer.Option(Path("ctxc-generate"), "--out", help="Output folder."),
    device: str = DEVICE,
    device_map: str = DEVICE_MAP,
    max_memory: str = MAX_MEMORY,
    force: bool = FORCE,
    image: list[Path] = typer.Option(
        None, "--image", metavar="<path>", help="Image file (PNG, JPEG) in the context; repeat."
    ),
    verbose: bool = VERBOSE,
) -> None:
    """The paper's protocol: recompile the patch at every token against greedy generation."""
    if context is None and not image:
        raise CtxcError("missing option '--context'")
    text = read_context(context) if context is not None else ""
    if image:
        from ctxc.models.images import read_images

        read_images(image)  # every image read now, before the model loads
    from ctxc.core.options import GenerateOptions

    options = GenerateOptions(max_new_tokens, update)  # validated here, once
    where = placement_for(device, device_map, max_memory)
    with output_folder(out_dir, force, "generate") as tmp:
        from ctxc.generate.report import plot_steps, steps_table, write_json
        from ctxc.generate.steps import generate
        from ctxc.models.load import check_length

        net, tokenizer = load(model, dtype, where)
        if image:
            ids, prefill = generate_inputs(net, model, text, image)
        else:
            ids, prefill = list(tokenizer(text).input_ids), None
        check_length(net, len(ids) + max_new_tokens, f"context + {max_new_tokens} new tokens")
        with progress() as bar:
            task = bar.add_task("generating", total=max_new_tokens, unit="tokens")
            result = generate(
                net,
                ids,
                on_step=lambda s: bar.update(task, completed=s.step + 1),
                prefill=prefill,
                options=options,
            )
        tokens = [tokenizer.decode([s.baseline_token]) for s in result.steps]
        write_json(result, tmp / "generate.json", tokens)
        plotted = plot_steps(result, tmp / "generate.png")
    say(steps_table(result, tokenizer.decode))
    summary = result.to_dict()["summary"]
    say(
        f"top-1 match {summary['top1_match_rate']:.1%} over {summary['steps']} steps; "
        f"max |logit diff| {summary['max_abs_logit_diff']:.3g}; "
        f"mean step {result.timings['steps'] / max(1, len(result.steps)):.3f} s "
        f"(targets from {result.targets_from})"
    )
    if plotted is None:
        err.print(
            "ctxc: generate.png skipped: matplotlib is not installed (pip install 'ctxc[plot]')",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    say(f"wrote {out_dir}/ (generate.json{', generate.png' if plotted else ''})")


def main(argv: list[str] | None = None) -> int:
    """Console entry point: runs the app; every error becomes one line and an exit code.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        the exit status (see the module docstring).
    """
    quiet_defaults()  # third-party warnings and bars off; -v/--verbose turns them back on
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    restore = install_handlers()
    try:
        return _run(argv)
    finally:
        restore()


def _run(argv: list[str] | None) -> int:
    try:
        with command_trail():  # the progress display ends before any error line is printed
            rc = app(args=argv, standalone_mode=False, prog_name="ctxc")
            finish(ok=not rc)  # typer returns 130 after Ctrl-C: no "done" then
    except KeyboardInterrupt:
        rc = 130
    except CtxcError as exc:
        return _error(cli_message(exc))
    except Exception as exc:
        missing = missing_package_error(exc, "this run")  # torchvision, timm, Pillow
        if missing is not None:
            return _error(str(missing))
        if is_click(exc, "NoArgsIsHelpError"):  # `ctxc` alone: the help, like --help
            say(exc.format_message())
            return 0
        if is_click(exc, "ClickException"):
            return _error(
                usage_message(exc, sys.argv[1:] if argv is None else argv, command_names())
            )
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
    if rc == 130:  # typer turns KeyboardInterrupt into Exit(130) and returns the code
        err.print("ctxc: interrupted", highlight=False)
        return 128 + received()
    return int(rc or 0) if isinstance(rc, int) else 0


def command_names() -> list[str]:
    """The names of the app's commands, sorted."""
    return sorted(cmd.name or "" for cmd in app.registered_commands)


def _error(message: str) -> int:
    err.print(f"ctxc: error: {message}", highlight=False, soft_wrap=True, markup=False)
    return 2


if __name__ == "__main__":
    sys.exit(main())
