"""``ctxc compile``: one context into patch.safetensors, report.json and the asked artefacts.

The single compile every context goes through, alone or one line of a ``--contexts`` run
(``compiler/cli/batch.py``, the batch stage ``ctxc.batch``), is
:func:`ctxc.batch.job.compile_into`. No torch import at module level.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ctxc.backends import check_rules
from ctxc.batch.job import CompileJob, compile_into
from ctxc.cli.batch import compile_batch
from ctxc.cli.images import image_options, processor_of
from ctxc.cli.options import (
    CHAT,
    DEVICE,
    DEVICE_MAP,
    DOCUMENT,
    DTYPE,
    FORCE,
    IMAGES,
    MAX_MEMORY,
    MESSAGES,
    MODEL,
    SYSTEM,
    UPDATE,
    DType,
    Engine,
    GgufType,
    Update,
    emit_help,
    placement_for,
)
from ctxc.cli.progress import VERBOSE, say, stage, stage_progress
from ctxc.cli.support import (
    chat_input,
    check_chat,
    load,
    parse_emit,
    read_context,
    summaries,
    written,
)
from ctxc.core.errors import CtxcError
from ctxc.core.options import CompileOptions
from ctxc.core.vocabulary import GGUF_F32
from ctxc.store.output import output_folder

__all__ = ["compile_cmd"]

# Where the lines of --contexts compile (docs/cluster.md): here, or on a Ray cluster's workers.
ENGINE = typer.Option(
    "local",
    "--engine",
    help="With --contexts: local (this process) or ray (a Ray cluster's workers; ctxc[ray]).",
)
ADDRESS = typer.Option(
    None, "--address", help="With --engine ray: the Ray cluster (default: a local one)."
)
WORKERS = typer.Option(
    None, "--workers", help="With --engine ray: workers, one model each (default: the CPUs)."
)
GPUS = typer.Option(0.0, "--gpus-per-worker", help="With --engine ray: GPUs per worker.")


def compile_cmd(
    context: Path = typer.Option(None, "--context", help="UTF-8 text file with the context."),
    contexts: Path = typer.Option(
        None, "--contexts", help="JSON Lines: one {context, query?, name?} per line."
    ),
    model: str | None = MODEL,
    query: str = typer.Option(
        None,
        "--query",
        help="Query text (default: last context token; with --chat: the next user message).",
    ),
    chat: bool = CHAT,
    system: Path = SYSTEM,
    document: Path = DOCUMENT,
    messages: Path = MESSAGES,
    out_dir: Path = typer.Option(Path("ctxc-out"), "--out", help="Output folder."),
    update: Update = UPDATE,
    dtype: DType = DTYPE,
    emit: str = typer.Option("torch", "--emit", help=emit_help("Comma list of artefacts")),
    gguf_type: GgufType = typer.Option(GGUF_F32, "--gguf-type", help="GGUF matrix type."),
    start_layer: int = typer.Option(0, "--start-layer", help="First block to patch."),
    skip_unpatchable: bool = typer.Option(
        False, "--skip-unpatchable", help="Patch the other blocks when some admit no patch."
    ),
    device: str = DEVICE,
    device_map: str = DEVICE_MAP,
    max_memory: str = MAX_MEMORY,
    force: bool = FORCE,
    image: list[Path] = IMAGES,
    resume: bool = typer.Option(
        False, "--resume", help="With --contexts: keep the lines an earlier run wrote in --out."
    ),
    engine: Engine = ENGINE,
    address: str = ADDRESS,
    workers: int = WORKERS,
    gpus_per_worker: float = GPUS,
    verbose: bool = VERBOSE,
) -> None:
    """Compile a context into a patch; write patch.safetensors, report.json and artefacts."""
    if image and contexts is not None:
        raise CtxcError("--image applies to --context (or to no context: the images alone)")
    conversation = _conversation(
        chat, (context, contexts, image), system, document, messages, query
    )
    if context is None and contexts is None and not image and conversation is None:
        raise CtxcError("missing option '--context' (or '--contexts' for a JSON Lines file)")
    if context is not None and contexts is not None:
        raise CtxcError("--context and --contexts are mutually exclusive: give one")
    kinds = parse_emit(emit)
    where = placement_for(device, device_map, max_memory, kinds)
    compiling = CompileOptions(update, start_layer, skip_unpatchable)  # validated here, once
    check_rules(kinds, compiling.update)  # lora/gguf-lora need --update lora: known now
    opts = CompileJob(compiling, kinds, gguf_type, placement=where)
    on = _engine(contexts, resume, engine, address, workers, gpus_per_worker)
    if contexts is not None:
        if query is not None:
            raise CtxcError("--query applies to --context; give each query in the JSON lines")
        raise typer.Exit(compile_batch(contexts, out_dir, model, dtype, force, opts, resume, on))
    if conversation is not None:
        if image:
            opts = image_options(opts, image)  # every image read now, before the model loads
        return _compile_chat(model, dtype, where, out_dir, force, opts, conversation)
    text = read_context(context) if context is not None else ""  # the query: the library's
    if image:
        opts = image_options(opts, image)  # every image read now, before the model loads
    with output_folder(out_dir, force, "compile") as tmp:
        net, tokenizer = load(model, dtype, where)
        if image:
            tokenizer = processor_of(net, model)
        with stage_progress("compiling", "solving") as (on_stage, on_block):
            report, figures = compile_into(
                net,
                tokenizer,
                tmp,
                text,
                query,
                opts,
                on_emit=stage,
                on_stage=on_stage,
                on_block=on_block,
            )
    say(report.summary(tokenizer.decode if hasattr(tokenizer, "decode") else None))
    for line in summaries(figures.values()):
        say(line)
    say(f"wrote {out_dir}/ ({', '.join(written(opts.kinds))})")


def _engine(contexts, resume: bool, engine: str, address, workers, gpus: float):
    """The Ray engine of ``--engine ray`` (ray checked now, before anything loads), or None.

    Raises:
        CtxcError: a ``--contexts`` option without ``--contexts``, a Ray option without
            ``--engine ray``, or ray not installed.
    """
    ray_flags = {"--address": address, "--workers": workers, "--gpus-per-worker": gpus or None}
    given = [flag for flag, value in ray_flags.items() if value is not None]
    if contexts is None:
        for flag, value in (("--resume", resume), ("--engine", engine != "local")):
            if value:
                raise CtxcError(f"{flag} applies to --contexts")
    if engine == "local":
        if given:
            raise CtxcError(f"{given[0]} applies to --engine ray")
        return None
    from ctxc.batch.ray_engine import RayEngine, require_ray

    require_ray()
    return RayEngine(address=address, workers=workers, gpus_per_worker=gpus)


def _conversation(chat: bool, others: tuple, system, document, messages, query):
    """``--chat``'s conversation, read and checked (``chat_input``), or None without it.

    Args:
        others: ``(--context, --contexts, --image)`` as given.
    """
    context, contexts, image = others
    if chat and (context is not None or contexts is not None):
        raise CtxcError(
            "--chat takes --system, --document or --messages, not --context or --contexts (in "
            "--contexts, a line with messages, system or document is a chat line)"
        )
    if chat and image and messages is None:
        raise CtxcError('with --chat, --image takes --messages: its {"type": "image"} parts')
    return chat_input(chat, system, document, messages, query)


def _compile_chat(model, dtype, where, out_dir: Path, force: bool, opts, conversation) -> None:
    """``ctxc compile --chat``: the conversation's context turns compiled for its query turn.

    Args:
        conversation: ``(context turns, query)``, read and checked (``chat_input``).

    Side effects:
        writes ``out_dir`` (nothing when the template cannot be split: the error is raised
        inside the staging folder, which is removed).
    """
    turns, query = conversation
    if not opts.images:  # an image conversation is rendered by the processor, with the model
        check_chat(model, turns, query)
    with output_folder(out_dir, force, "compile") as tmp:
        net, tokenizer = load(model, dtype, where)
        if opts.images:  # the processor renders and tokenises an image conversation
            tokenizer = processor_of(net, model)
        with stage_progress("compiling", "solving") as (on_stage, on_block):
            report, figures = compile_into(
                net,
                tokenizer,
                tmp,
                None,
                query,
                opts,
                messages=turns,
                on_emit=stage,
                on_stage=on_stage,
                on_block=on_block,
            )
    say(report.summary(getattr(tokenizer, "decode", None)))
    for line in summaries(figures.values()):
        say(line)
    say(f"wrote {out_dir}/ ({', '.join(written(opts.kinds))})")
