"""``ctxc bake`` and ``ctxc eval-bake``: the flags parsed, the bake run by the stage
(``ctxc.bake``), its lines printed.

The fit's options are not written here: each ``BakeOptions`` field declares its flag, help
text, group and default once (``compiler/core/options.py``), and :func:`_bake_parameters`
builds the command's options from them (a ``--help`` panel per group). What only the command
has (its inputs, outputs, held-out files) is declared below. No torch import at module level
(``ctxc --help`` stays fast).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import Field
from pathlib import Path
from typing import Any, Literal

import typer

from ctxc.bake import CHUNK_WORDS, ChunkProgress, HeldOut
from ctxc.cli.options import CHAT, DOCUMENT, FORCE, MODEL, SYSTEM, Engine, emit_help, flag_of
from ctxc.cli.progress import VERBOSE, is_verbose, quiet_defaults, say, stage, stage_progress
from ctxc.cli.support import chat_input, load, parse_emit, read_context
from ctxc.core.errors import CtxcError
from ctxc.core.options import BAKE_GROUPS, BakeOptions, bake_fields
from ctxc.core.vocabulary import ADDITIVE_METHOD, DISTILL_METHOD

__all__ = ["bake_cmd", "eval_bake_cmd", "parse_rank"]

# The user turn --chat splits the context turns with while reading the files (any query would
# do: the context's ids are the same for every one).
_PROBE = "What is it about?"
_PANEL = "Input and output"


def parse_rank(rank: str) -> int | None:
    """``full`` or ``auto`` -> None, else the integer (``BakeOptions`` checks its range); a
    CtxcError for anything else."""
    if rank.strip().lower() in ("full", "auto"):
        return None
    try:
        return int(rank)
    except ValueError:
        raise CtxcError(f"--rank {rank!r} is not an integer, 'full' or 'auto'") from None


# What only the command takes, besides the shared options below: its inputs, outputs, held-out
# files, the chunk and route options (name, type, default, flag, help).
_OWN: tuple[tuple[str, Any, Any, str, str], ...] = (
    (
        "context",
        list[Path],
        None,
        "--context",
        "UTF-8 text file with the context; repeat: chunks (additive, routed).",
    ),
    (
        "messages",
        Path,
        None,
        "--messages",
        "With --chat: JSON file, a list of {role, content}: the context turns.",
    ),
    ("queries", Path, None, "--queries", "Fit queries, one per line."),
    (
        "add",
        Path,
        None,
        "--add",
        "Add the --context chunk(s) to the additive or routed bake in this folder.",
    ),
    (
        "remove",
        Path,
        None,
        "--remove",
        "Remove --chunk from the additive or routed bake in this folder.",
    ),
    ("chunk", str, None, "--chunk", "With --remove: the chunk's id (or file name)."),
    (
        "route",
        bool,
        False,
        "--route",
        "Long documents: cut --context (with --chat: the --system file, each chunk a system "
        "turn) at blank lines into chunks of paragraphs, bake each alone, keep a BM25 router "
        "(ctxc route DIR --query TEXT picks the chunk's patch).",
    ),
    (
        "chunk_words",
        int,
        CHUNK_WORDS,
        "--chunk-words",
        "With --route: most words of a chunk joining paragraphs.",
    ),
    (
        "resume",
        bool,
        False,
        "--resume",
        "With --route: keep the chunks an earlier run into --out baked, bake the rest.",
    ),
    (
        "workers",
        int,
        None,
        "--workers",
        "With --route: chunks baked side by side, one model each (1: in this process; default: "
        "the threads and memory allow; --engine ray: the Ray pool).",
    ),
    (
        "engine",
        Engine,
        "local",
        "--engine",
        "With --route: local (worker processes here) or ray (a Ray cluster's workers: the ray "
        "extra).",
    ),
    ("address", str, None, "--address", "With --engine ray: the Ray cluster (default: local)."),
    ("eval_queries", Path, None, "--eval-queries", "Held-out queries file."),
    (
        "eval_questions",
        Path,
        None,
        "--eval-questions",
        "Held-out questions, one per line (answers compared).",
    ),
    ("eval_samples", int, HeldOut().samples, "--eval-samples", "Held-out samples (seed + 1)."),
    (
        "eval_off_topic",
        int,
        HeldOut().off_topic,
        "--eval-off-topic",
        "Off-topic samples and as many questions, written from the BOS alone (seed + 5), fed "
        "after the context: the patch against the model reading the context, off it.",
    ),
    ("out_dir", Path, Path("ctxc-bake"), "--out", "Output folder."),
)
# The options other commands share, declared once in ctxc.cli.options.
_SHARED: tuple[tuple[str, Any, Any], ...] = (
    ("chat", bool, CHAT),
    ("system", Path, SYSTEM),
    ("document", Path, DOCUMENT),
    ("model", str | None, MODEL),
    ("force", bool, FORCE),
    ("verbose", bool, VERBOSE),
)


def _parameter(name: str, annotation: Any, info: Any) -> inspect.Parameter:
    """A keyword parameter of ``bake_cmd`` as typer reads it (``info``: its ``typer.Option``)."""
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation
    )


def _command_parameters() -> list[inspect.Parameter]:
    """The command's own options (:data:`_OWN`, ``--emit`` from the backends' registry) and
    the shared ones."""
    own = [
        _parameter(name, kind, typer.Option(default, flag, help=text, rich_help_panel=_PANEL))
        for name, kind, default, flag, text in _OWN
    ]
    emit = typer.Option("torch", "--emit", help=emit_help("Comma list"), rich_help_panel=_PANEL)
    shared = [_parameter(name, kind, info) for name, kind, info in _SHARED]
    return [*own, _parameter("emit", str, emit), *shared]


def _bake_parameters() -> list[inspect.Parameter]:
    """One command option per ``BakeOptions`` field that has a flag: its default, help and
    group from the field (``--rank`` takes ``full`` and ``auto`` too: text)."""
    params = []
    for f in bake_fields():
        flag = f.metadata["flag"]
        if flag is None:
            continue  # library-only
        annotation, default = _field_type(f), f.default
        decls = [flag if "negative" not in f.metadata else f"{flag}/{f.metadata['negative']}"]
        if f.name == "rank":
            annotation, default = str, str(default)
        info = typer.Option(
            default,
            *decls,
            help=f.metadata["help"],
            rich_help_panel=BAKE_GROUPS[f.metadata["group"]],
            show_default=default is not None,
        )
        params.append(_parameter(f.name, annotation, info))
    return params


def _field_type(f: Field) -> Any:
    """The command's type of a ``BakeOptions`` field: its choices as a ``Literal`` (typer lists
    them and refuses others), else the field's own."""
    choices = f.metadata.get("choices")
    if choices is not None:
        return Literal[tuple(choices)]
    return _TYPES[str(f.type)]


# BakeOptions' field types as written there (its annotations are strings: PEP 563).
_TYPES: dict[str, Any] = {
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
    "bool | None": bool | None,
    "float | None": float | None,
    "int | None": int | None,
}


def _options_of(ctx: typer.Context, given: dict) -> BakeOptions:
    """The command's fit options as :class:`BakeOptions` (validated there, once); ``--rank
    auto`` is each block's own rank. Options of another method than ``--method`` are refused
    when given at all (the library refuses them when they differ from the default)."""
    fields = {f.name: given[f.name] for f in bake_fields() if f.name in given}
    rank = fields.pop("rank")
    if fields["method"] != DISTILL_METHOD:
        other = [f.metadata["flag"] for f in bake_fields("distill") if _given(ctx, f.name)]
        if other:
            raise CtxcError(f"{other[0]} is for --method distill (not {fields['method']})")
    return BakeOptions(
        rank=parse_rank(rank), rank_per_block=rank.strip().lower() == "auto", **fields
    )


def bake_cmd(ctx: typer.Context, **given: Any) -> None:
    """Bake a context into one reusable patch, fitted over many queries (thought patch)."""
    from ctxc.bake import BakeHooks, BakeJob, HeldOut, check_servable, is_routed

    a = _Args(given)
    if not a.route:
        _refuse_route_flags(ctx)
    for flag, value in (("--eval-samples", a.eval_samples), ("--eval-off-topic", a.eval_off_topic)):
        if value < 0:
            raise CtxcError(f"{flag} must be at least 0 (got {value})")
    held = HeldOut(
        _lines(a.eval_queries), _lines(a.eval_questions), a.eval_samples, a.eval_off_topic
    )
    queries = _lines(a.queries)
    kinds = parse_emit(a.emit)
    hooks = BakeHooks(on_stage=stage, progress=stage_progress, load=lambda m, d: load(m, d))
    contexts = list(a.context or [])
    if a.add is not None or a.remove is not None:
        _check_chunk_flags(a.add, a.remove, a.chunk, contexts, a.chat)
        _refuse_fit_flags(ctx, "--add DIR" if a.add is not None else "--remove DIR")
        folder = a.add or a.remove
        named = [(p.name, read_context(p)) for p in contexts]
        if is_routed(folder):
            _change_routed(ctx, folder, named, queries, a.chunk, held, a.model, hooks)
        else:
            _change_additive(folder, named, queries, a.chunk, held, kinds, a.model, hooks)
        return
    if a.chunk is not None:
        raise CtxcError("--chunk goes with --remove DIR")
    opts = _options_of(ctx, given)
    check_servable(kinds, opts, a.rank)
    job = BakeJob(
        a.out_dir,
        queries=queries,
        options=opts,
        held=held,
        emit=tuple(kinds),
        model=a.model,
        force=a.force,
    )
    if a.route:
        _routed(ctx, a, job, contexts, hooks)
    elif len(contexts) > 1 or opts.method == ADDITIVE_METHOD:
        _additive(ctx, a, job, contexts, hooks)
    else:
        _single(ctx, a, job, contexts, hooks)


class _Args:
    """The command's own parameters by name (``a.context``); the fit's are ``BakeOptions``."""

    def __init__(self, given: dict) -> None:
        self.__dict__.update(given)

    def __getattr__(self, name: str) -> Any:  # for mypy: every parameter is set in __init__
        raise AttributeError(name)


def _single(ctx: typer.Context, a: _Args, job, contexts: list[Path], hooks) -> None:
    """A plain or chat bake: one context, one patch."""
    from dataclasses import replace

    from ctxc.bake import bake_into

    if _given(ctx, "chunk_words"):
        raise CtxcError("--chunk-words goes with --route")
    first = contexts[0] if contexts else None
    text, turns = _context(a.chat, first, a.system, a.document, a.messages)
    job = replace(job, context=text, messages=tuple(turns) if turns is not None else None)
    run = bake_into(job, hooks)
    _say_all([*run.lines, *_chat_lines(run.report), f"wrote {a.out_dir}/"])


def _additive(ctx: typer.Context, a: _Args, job, contexts: list[Path], hooks) -> None:
    """``--method additive`` (or several ``--context`` chunks): the chunks' statistics summed."""
    from dataclasses import replace

    from ctxc.bake import bake_additive

    if _given(ctx, "chunk_words"):
        raise CtxcError("--chunk-words goes with --route")
    if a.chat:
        raise CtxcError("--method additive takes --context files (chunks), not --chat turns")
    if len(contexts) > 1 and job.options.method != ADDITIVE_METHOD:
        raise CtxcError("several --context files are chunks: they need --method additive")
    if not contexts:
        raise CtxcError("missing option '--context'")
    named = tuple((p.name, read_context(p)) for p in contexts)
    run = bake_additive(replace(job, chunks=named), hooks)
    _say_all([*run.lines, f"wrote {a.out_dir}/"])


def _routed(ctx: typer.Context, a: _Args, job, contexts: list[Path], hooks) -> None:
    """``--route``: each chunk of the documents baked alone, a router beside them; with
    ``--chat``, the ``--system`` file's chunks, each baked as ``--chat --system CHUNK`` is."""
    from dataclasses import replace

    from ctxc.bake import bake_routed

    if job.queries is not None:
        raise CtxcError("--route fits each chunk on its own data (no --queries)")
    if job.options.method == ADDITIVE_METHOD:
        raise CtxcError("--route bakes each chunk alone: give --method fit or distill")
    named = _route_documents(a, contexts)
    # A chunk's folder holds its patch; artefacts only when asked for (--emit torch writes
    # a model/ per chunk, 283 MB of patched shard each on Gemma 3 270M).
    emit = job.emit if _given(ctx, "emit") else ()
    hooks = replace(
        hooks,
        on_chunks=_say_chunks,
        setup=None if is_verbose() else quiet_defaults,  # a worker process never ran main
        name_of=flag_of,
    )
    run = bake_routed(
        replace(job, chunks=named, emit=emit),
        a.chunk_words,
        hooks,
        chat=a.chat,
        workers=a.workers,
        engine=a.engine,
        address=a.address,
        resume=a.resume,
    )
    n = len(run.report["chunk_ids"])
    closing = f"wrote {a.out_dir}/ ({n} chunks; ctxc route {a.out_dir} --query TEXT picks one)"
    # Chat chunks: how to feed each chunk's patched model (one template: the same for all).
    first = run.report["chunks"][run.report["chunk_ids"][0]]
    _say_all([*run.lines, *_chat_lines(first), closing])


def _route_documents(a: _Args, contexts: list[Path]) -> tuple[tuple[str, str], ...]:
    """``(file name, text)`` of the documents ``--route`` cuts into chunks: the ``--context``
    files, or with ``--chat`` the one ``--system`` file (read and checked now).

    Raises:
        CtxcError: no document; with ``--chat``, ``--context``, ``--document`` or
            ``--messages`` (each chunk is a system turn alone), or no ``--system``; a chat
            file without ``--chat``.
    """
    if not a.chat:
        chat_input(False, a.system, a.document, a.messages, _PROBE)  # a chat file: refused
        if not contexts:
            raise CtxcError("missing option '--context' (--route cuts a document into chunks)")
        return tuple((p.name, read_context(p)) for p in contexts)
    for flag, given in (
        ("--context", contexts),
        ("--document", a.document),
        ("--messages", a.messages),
    ):
        if given:
            raise CtxcError(
                f"--route --chat cuts the --system file into chunks, each chunk a system turn "
                f"alone: give the document as --system FILE, not {flag}"
            )
    if a.system is None:
        raise CtxcError("--route --chat needs --system FILE (the document cut into chunks)")
    got = chat_input(True, a.system, None, None, _PROBE)  # the file read as --chat reads it
    assert got is not None  # with --chat: the turns, or a CtxcError
    return ((a.system.name, got[0][0]["content"]),)


def _say_chunks(p: ChunkProgress) -> None:
    """A routed bake's line per chunk baked: chunks done of all, the time so far and left."""
    if not p.baked:
        return  # kept from an earlier run: counted in the next line
    kept = f", {p.kept} kept" if p.kept else ""
    left = "" if p.left_s is None or p.done == p.total else f", about {_duration(p.left_s)} left"
    stage(f"chunks {p.done}/{p.total} baked{kept}: {_duration(p.elapsed_s)}{left}", keep=True)


def _duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _refuse_route_flags(ctx: typer.Context) -> None:
    """One line for a routed bake's run flags given without ``--route``."""
    for name, flag in (
        ("resume", "--resume"),
        ("workers", "--workers"),
        ("engine", "--engine"),
        ("address", "--address"),
    ):
        if _given(ctx, name):
            raise CtxcError(f"{flag} goes with --route")


def _change_routed(ctx, folder, named, queries, chunk, held, model, hooks) -> None:
    """``--add DIR`` / ``--remove DIR`` on a routed bake: new chunks fitted and written as
    DIR's others were."""
    from ctxc.bake import change_routed

    if queries is not None:
        raise CtxcError("a routed bake fits each chunk without --queries")
    if _given(ctx, "emit"):
        raise CtxcError("a routed bake's chunks carry the artefacts it was baked with")
    run = change_routed(folder, named, chunk, held, model, hooks)
    _say_all([*run.lines, f"wrote {folder}/ ({len(run.report['chunk_ids'])} chunks)"])


def _change_additive(folder, named, queries, chunk, held, kinds, model, hooks) -> None:
    """``--add DIR`` / ``--remove DIR`` on an additive bake: its statistics with a chunk more
    or less, the patch solved again, DIR replaced once all of it is written."""
    from ctxc.bake import change_additive

    run = change_additive(folder, named, chunk, queries, held, kinds, model, hooks)
    _say_all([*run.lines, f"wrote {folder}/"])


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given on the command line (not its default)."""
    # By name: typer may carry its own copy of click, whose enum is not click's.
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def _refuse_fit_flags(ctx: typer.Context, what: str) -> None:
    """One line for fit options given beside ``--add``/``--remove``: DIR's bake fixed them
    (every ``BakeOptions`` flag, ``--route`` and ``--chunk-words``)."""
    fit = {f.name for f in bake_fields()} | {"route", "chunk_words"}
    given = [p.opts[0] for p in ctx.command.params if p.name in fit and _given(ctx, p.name)]
    if given:
        raise CtxcError(
            f"{what} fits with the options DIR was baked with: {', '.join(given)} cannot "
            "change them (bake the chunks anew for other options)"
        )


def _check_chunk_flags(add, remove, chunk, contexts: list, chat: bool) -> None:
    """Refuse a ``--add``/``--remove`` that is not one of: ``--add DIR --context F...``,
    ``--remove DIR --chunk ID``."""
    if add is not None and remove is not None:
        raise CtxcError("give --add DIR or --remove DIR, not both")
    if chat:
        raise CtxcError("--add and --remove take --context chunks, not --chat turns")
    if add is not None and (not contexts or chunk is not None):
        raise CtxcError("--add DIR takes the new chunk as --context FILE (and no --chunk)")
    if remove is not None and (contexts or chunk is None):
        raise CtxcError("--remove DIR takes --chunk ID (and no --context)")


def _context(chat: bool, context, system, document, messages) -> tuple:
    """(the ``--context`` file's text, None), or with ``--chat`` (None, the context turns, read
    and checked by ``chat_input``).

    Raises:
        CtxcError: ``--chat`` with ``--context``, a chat file without ``--chat``, ``--chat``
            without one, no context at all, a bad file.
    """
    if chat and context is not None:
        raise CtxcError(
            "--chat takes the context as turns (--system, --document or --messages), not --context"
        )
    got = chat_input(chat, system, document, messages, _PROBE)  # the probe: the next turn
    if got is not None:
        return None, got[0]
    if context is None:
        raise CtxcError(
            "missing option '--context' (or --chat with --system, --document or --messages)"
        )
    return read_context(context), None


def _chat_lines(report: dict) -> list[str]:
    """How to feed a chat bake's patched model (nothing for a plain bake)."""
    chat = report.get("chat")
    if chat is None:
        return []
    if chat["opening_is_the_template_s"]:
        how = "its chat template applied to the user's message alone"
    else:
        how = "the user's turn as the template renders it after the context, after the BOS"
    return [f"chat: the patched model answers {how} ({len(chat['opening_ids'])} opening tokens)"]


def _lines(path: Path | None) -> tuple[str, ...] | None:
    """The non-blank lines of a query file (one line naming a bad file), None without one."""
    if path is None:
        return None
    from ctxc.core.textfile import read_text

    return tuple(
        line.strip() for line in read_text(path, "query file").splitlines() if line.strip()
    )


def _say_all(lines: list[str]) -> None:
    for line in lines:
        say(line)


def eval_bake_cmd(
    folder: Path = typer.Argument(..., help="A ctxc bake output folder."),
    queries: Path = typer.Option(None, "--queries", help="Held-out queries, one per line."),
    samples: int = typer.Option(0, "--samples", help="Held-out samples to draw."),
    seed: int = typer.Option(1, "--seed", help="Seed of the held-out samples."),
    gen_tokens: int = typer.Option(32, "--gen-tokens", help="Greedy tokens per query."),
    model: str | None = MODEL,
    verbose: bool = VERBOSE,
) -> None:
    """Measure a baked patch on held-out queries against the model fed the context."""
    from ctxc.bake import BakeHooks, evaluate_folder, summary_lines

    texts = _lines(queries)
    hooks = BakeHooks(on_stage=stage, load=lambda m, d: load(m, d))
    figures = evaluate_folder(folder, list(texts or []), samples, seed, gen_tokens, model, hooks)
    _say_all(summary_lines(figures))
    say(json.dumps(figures))


def _signature() -> inspect.Signature:
    """``bake_cmd``'s signature as typer reads it: the context, then every option."""
    ctx = inspect.Parameter(
        "ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context
    )
    return inspect.Signature([ctx, *_command_parameters(), *_bake_parameters()])


bake_cmd.__signature__ = _signature()  # type: ignore[attr-defined]
bake_cmd.__annotations__ = {p.name: p.annotation for p in _signature().parameters.values()}
