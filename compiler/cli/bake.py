"""``ctxc bake`` and ``ctxc eval-bake``: thought patches from the command line (issue 13).

No torch import at module level (``ctxc --help`` stays fast).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ctxc.bake.route import CHUNK_WORDS, Router
from ctxc.cli.options import (
    CHAT,
    DOCUMENT,
    FORCE,
    MODEL,
    SYSTEM,
    BakeData,
    BakeMethod,
    ClozeForm,
    ClozeTeacher,
    FitRows,
    QuestionPrompt,
)
from ctxc.cli.progress import VERBOSE, say, stage, stage_progress
from ctxc.cli.route import is_routed, routed_bake, routed_change
from ctxc.cli.support import chat_input, check_chat, load, parse_emit, read_context
from ctxc.core.errors import CtxcError
from ctxc.core.options import BakeOptions
from ctxc.core.vocabulary import PATCH_FILE
from ctxc.store.output import output_folder

__all__ = [
    "DEFAULT_RANK",
    "EVAL_SAMPLES",
    "EVAL_TOKENS",
    "FIT_EVAL",
    "bake_cmd",
    "eval_bake_cmd",
    "parse_rank",
]

# The report's figures, kept within the default's time budget (docs/results/bake_defaults.md):
# held-out samples of EVAL_TOKENS tokens (greedy generation as long), the fit set's first
# FIT_EVAL queries.
EVAL_SAMPLES = 8
EVAL_TOKENS = 16
FIT_EVAL = 8
_DEFAULTS = BakeOptions()
DEFAULT_RANK = 64  # R = 64 was as good as full in issue 13's table, and cheaper to apply
_QUESTIONS = typer.Option(
    _DEFAULTS.questions, "--questions", help="Self-study questions the model writes."
)
_ANSWER_TOKENS = typer.Option(
    _DEFAULTS.answer_tokens, "--answer-tokens", help="Greedy tokens per self-study answer."
)
_QUESTION_PROMPT = typer.Option(
    _DEFAULTS.question_prompt,
    "--question-prompt",
    help="How the model is asked for a self-study question: plain or facts.",
)
_QUESTION_TEMPERATURE = typer.Option(
    _DEFAULTS.question_temperature,
    "--question-temperature",
    help="Sampling temperature of the self-study questions.",
)
_TOPICS = typer.Option(
    _DEFAULTS.topics,
    "--topics",
    help="Topic questions ('What does the text say about X?') on the context's first names "
    "and numbers.",
)
_CLOZE = typer.Option(
    _DEFAULTS.cloze,
    "--cloze",
    help="Extractive questions: a sentence of the context asking for one of its names or "
    "numbers, answered by that span.",
)
_CLOZE_FORM = typer.Option(
    _DEFAULTS.cloze_form,
    "--cloze-form",
    help="How a cloze question is cut: sentence, clause, or both (each span asked both ways).",
)
_CLOZE_TEACHER = typer.Option(
    _DEFAULTS.cloze_teacher,
    "--cloze-teacher",
    help="Whose reading gives a cloze question's targets: plain (the model after the context) "
    "or shown (after it has read the question and its answer once).",
)
_FIT_ROWS = typer.Option(
    _DEFAULTS.fit_rows,
    "--fit-rows",
    help="fit: a self-study query's positions fitted: all, or its answer's only.",
)
_RANK_OPTION = typer.Option(
    str(DEFAULT_RANK),
    "--rank",
    help="Rank budget per matrix, 'full', or 'auto' (each block's own).",
)
_LR = typer.Option(None, "--lr", help="distill: learning rate (1e-3; 1e-4 with --from-fit).")
_REFIT = typer.Option(
    _DEFAULTS.refit_passes, "--refit-passes", help="fit: passes refitting the error left."
)
_SECONDS = typer.Option(
    None, "--seconds", help="distill: train for this wall time instead of --steps."
)
_ATTENTION = typer.Option(
    None,
    "--attention/--no-attention",
    help="Move the attention output projections too (sandwich-norm blocks: Gemma 2/3, OLMo "
    "2). Default: where the model has them; --attention refuses a model without.",
    show_default=False,
)
_ON_POLICY = typer.Option(
    None,
    "--on-policy/--no-on-policy",
    help="fit: fit again with the patched model's own answers, read by the full-context model. "
    "Default: in a chat bake (--chat), not in plain text.",
    show_default=False,
)
_EVAL_QUESTIONS = typer.Option(
    None, "--eval-questions", help="Held-out questions, one per line (answers compared)."
)
_MESSAGES = typer.Option(
    None, "--messages", help="With --chat: JSON file, a list of {role, content}: the context turns."
)
_LINEAR_ONLY = typer.Option(
    False,
    "--linear-only",
    help="fit: move linear weights only, no norm scale (servable: --emit lora,gguf-lora).",
)
_ADD = typer.Option(
    None,
    "--add",
    help="Add the --context chunk(s) to the additive bake in this folder (in place).",
)
_REMOVE = typer.Option(
    None, "--remove", help="Remove --chunk from the additive bake in this folder (in place)."
)
_CHUNK = typer.Option(None, "--chunk", help="With --remove: the chunk's id (or file name).")
_ROUTE = typer.Option(
    False,
    "--route",
    help="Long documents: cut --context at blank lines into chunks of paragraphs, bake each "
    "alone, keep a BM25 router (ctxc route DIR --query TEXT picks the chunk's patch).",
)
_CHUNK_WORDS = typer.Option(
    CHUNK_WORDS, "--chunk-words", help="With --route: most words of a chunk joining paragraphs."
)
# The user turn --chat splits the context turns with before the model loads (any query would do:
# the context's ids are the same for every one).
_PROBE = "What is it about?"


def parse_rank(rank: str) -> int | None:
    """``full`` or ``auto`` -> None, else the integer (``BakeOptions`` checks its range); a
    CtxcError for anything else."""
    if rank.strip().lower() in ("full", "auto"):
        return None
    try:
        return int(rank)
    except ValueError:
        raise CtxcError(f"--rank {rank!r} is not an integer, 'full' or 'auto'") from None


def bake_cmd(
    ctx: typer.Context,
    context: list[Path] = typer.Option(
        None, "--context", help="UTF-8 text file with the context; repeat: chunks (additive)."
    ),
    chat: bool = CHAT,
    system: Path = SYSTEM,
    document: Path = DOCUMENT,
    messages: Path = _MESSAGES,
    queries: Path = typer.Option(None, "--queries", help="Fit queries, one per line."),
    data: BakeData = typer.Option(
        _DEFAULTS.data, "--data", help="Fit data: continuations, self-study or both."
    ),
    samples: int = typer.Option(
        _DEFAULTS.samples, "--samples", help="K continuations sampled to fit on."
    ),
    sample_tokens: int = typer.Option(
        _DEFAULTS.sample_tokens, "--sample-tokens", help="Tokens per sample."
    ),
    questions: int = _QUESTIONS,
    answer_tokens: int = _ANSWER_TOKENS,
    question_prompt: QuestionPrompt = _QUESTION_PROMPT,
    question_temperature: float = _QUESTION_TEMPERATURE,
    topics: int = _TOPICS,
    cloze: int = _CLOZE,
    cloze_form: ClozeForm = _CLOZE_FORM,
    cloze_teacher: ClozeTeacher = _CLOZE_TEACHER,
    fit_rows: FitRows = _FIT_ROWS,
    rank: str = _RANK_OPTION,
    method: BakeMethod = typer.Option("fit", "--method", help="fit (closed form) or distill."),
    ridge: float = typer.Option(1.0, "--ridge", help="Relative ridge of the matrix fits."),
    seed: int = typer.Option(0, "--seed", help="Sampling and training seed."),
    steps: int = typer.Option(200, "--steps", help="distill: optimiser steps."),
    seconds: float = _SECONDS,
    from_fit: bool = typer.Option(False, "--from-fit", help="distill: start from the fit."),
    lr: float = _LR,
    refit_passes: int = _REFIT,
    attention: bool | None = _ATTENTION,
    on_policy: bool | None = _ON_POLICY,
    linear_only: bool = _LINEAR_ONLY,
    add: Path = _ADD,
    remove: Path = _REMOVE,
    chunk: str = _CHUNK,
    route: bool = _ROUTE,
    chunk_words: int = _CHUNK_WORDS,
    eval_queries: Path = typer.Option(None, "--eval-queries", help="Held-out queries file."),
    eval_questions: Path = _EVAL_QUESTIONS,
    eval_samples: int = typer.Option(
        EVAL_SAMPLES, "--eval-samples", help="Held-out samples (seed + 1)."
    ),
    model: str | None = MODEL,
    emit: str = typer.Option(
        "torch", "--emit", help="Comma list: torch, onnx, peft, lora, gguf-lora, ort-adapter."
    ),
    out_dir: Path = typer.Option(Path("ctxc-bake"), "--out", help="Output folder."),
    force: bool = FORCE,
    verbose: bool = VERBOSE,
) -> None:
    """Bake a context into one reusable patch, fitted over many queries (thought patch)."""
    from ctxc.bake.data import read_queries
    from ctxc.bake.serve import check_servable

    contexts = list(context or [])
    held = _held_out(eval_queries, eval_questions, eval_samples)
    fit_texts = read_queries(queries) if queries is not None else None
    kinds = parse_emit(emit)
    if add is not None or remove is not None:
        _check_chunk_flags(add, remove, chunk, contexts, chat)
        _refuse_fit_flags(ctx, "--add DIR" if add is not None else "--remove DIR")
        folder = add or remove
        if is_routed(folder):
            _routed_change_cmd(ctx, folder, contexts, fit_texts, chunk, held, eval_samples, model)
        else:
            _chunk_cmd(folder, contexts, fit_texts, chunk, held, eval_samples, kinds, model)
        return
    if chunk is not None:
        raise CtxcError("--chunk goes with --remove DIR")
    opts = _bake_options(
        rank, data=data, samples=samples, sample_tokens=sample_tokens, questions=questions,
        answer_tokens=answer_tokens, question_prompt=question_prompt,
        question_temperature=question_temperature, topics=topics, cloze=cloze,
        cloze_form=cloze_form, cloze_teacher=cloze_teacher, fit_rows=fit_rows, method=method,
        ridge=ridge,
        seed=seed, distill_steps=steps, distill_seconds=seconds, distill_from_fit=from_fit,
        distill_lr=lr, refit_passes=refit_passes, attention=attention, linear_only=linear_only,
        on_policy=on_policy,
    )  # fmt: skip
    check_servable(kinds, opts, rank)
    if route:
        if chat or fit_texts is not None:
            raise CtxcError("--route takes --context files and fits each chunk on its own data "
                            "(no --chat, no --queries)")  # fmt: skip
        # A chunk's folder holds its patch; artefacts only when asked for (--emit torch writes
        # a model/ per chunk, 283 MB of patched shard each on Gemma 3 270M).
        kinds = kinds if _given(ctx, "emit") else []
        write = _writer(kinds, held, eval_samples, seed)
        routed_bake(contexts, opts, chunk_words, kinds, model, out_dir, force, write)
        return
    if _given(ctx, "chunk_words"):
        raise CtxcError("--chunk-words goes with --route")
    if len(contexts) > 1 or method == "additive":
        if chat:
            raise CtxcError("--method additive takes --context files (chunks), not --chat turns")
        if len(contexts) > 1 and method != "additive":
            raise CtxcError("several --context files are chunks: they need --method additive")
        named = [(p.name, read_context(p)) for p in contexts]
        if not named:
            raise CtxcError("missing option '--context'")
        _additive_cmd(named, fit_texts, opts, held, eval_samples, seed, kinds, model, out_dir,
                      force)  # fmt: skip
        return
    text, turns = _context(chat, contexts[0] if contexts else None, system, document, messages)
    if turns is not None:
        check_chat(model, turns, _PROBE)  # no template, or no split: one line, before the load
    with output_folder(out_dir, force, "bake") as tmp:
        from ctxc.bake.driver import bake

        net, tokenizer = load(model, "float32")
        with stage_progress("baking", "fitting") as (on_stage, on_block):
            result = bake(net, tokenizer, text, fit_texts, options=opts, messages=turns,
                          on_stage=on_stage, on_block=on_block)  # fmt: skip
        _writer(kinds, held, eval_samples, seed)(net, tokenizer, result, tmp)
    report = result.report
    _say_all([*_summary(report["figures"]), *_chat_lines(report), f"wrote {out_dir}/"])


def _routed_change_cmd(ctx, folder, contexts, fit_texts, chunk, held, eval_samples, model):
    """``--add DIR`` / ``--remove DIR`` on a routed bake (``ctxc.cli.route``): each new chunk
    fitted and written as DIR's others were."""
    if fit_texts is not None:
        raise CtxcError("a routed bake fits each chunk without --queries")
    if _given(ctx, "emit"):
        raise CtxcError("a routed bake's chunks carry the artefacts it was baked with")
    seed = int(Router.load(folder).options.get("seed", 0))
    routed_change(folder, contexts, chunk, model,
                  lambda kinds: _writer(kinds, held, eval_samples, seed))  # fmt: skip


def _writer(kinds: list[str], held: dict, eval_samples: int, seed: int):
    """``write(net, tokenizer, result, folder) -> figures``: a bake's folder (its figures in the
    report, the patch, the ``kinds`` artefacts checked, report.json)."""
    from ctxc.core.report import write_report

    def write(net, tokenizer, result, folder: Path) -> dict:
        report = result.report
        report["figures"] = _figures(net, tokenizer, result, held, eval_samples, seed)
        result.patch.save(folder / PATCH_FILE)
        artefacts = _emit(net, tokenizer, result.patch, folder, kinds) if kinds else {}
        write_report(folder, report, artefacts, under="artefacts")
        return report["figures"]

    return write


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option ``name`` was given on the command line (not its default)."""
    # By name: typer may carry its own copy of click, whose enum is not click's.
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


# What the fit is: an additive bake keeps it in DIR (stats.safetensors), and a chunk added or
# removed is fitted as the others were.
_FIT_PARAMS = (
    "data", "samples", "sample_tokens", "questions", "answer_tokens", "question_prompt",
    "question_temperature", "topics", "cloze", "cloze_form", "cloze_teacher",
    "fit_rows", "rank", "method",
    "ridge", "seed", "steps", "seconds", "from_fit", "lr", "refit_passes", "attention",
    "linear_only", "on_policy", "route", "chunk_words",
)  # fmt: skip


def _refuse_fit_flags(ctx: typer.Context, what: str) -> None:
    """One line for fit options given beside ``--add``/``--remove``: DIR's bake fixed them."""

    given = [
        p.opts[0]
        for p in ctx.command.params
        if p.name in _FIT_PARAMS and p.name is not None and _given(ctx, p.name)
    ]
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


def _additive_cmd(named, fit_texts, opts, held, eval_samples, seed, kinds, model, out_dir, force):
    """``ctxc bake --method additive``: the chunks' statistics summed, the patch solved."""
    with output_folder(out_dir, force, "bake") as tmp:
        from ctxc.bake.chunks import bake_chunks

        net, tokenizer = load(model, "float32")
        contexts = [(name, list(tokenizer(text).input_ids)) for name, text in named]
        with stage_progress("gathering", "statistics") as (on_stage, on_block):
            got = bake_chunks(net, tokenizer, contexts, fit_texts, options=opts,
                              on_stage=on_stage, on_block=on_block)  # fmt: skip
        lines = _write_chunks(net, tokenizer, got, tmp, kinds, held, eval_samples, seed)
    _say_all([*lines, f"wrote {out_dir}/"])


def _chunk_cmd(folder: Path, named_paths, fit_texts, chunk, held, eval_samples, kinds, model):
    """``--add DIR`` / ``--remove DIR``: DIR's statistics with a chunk more or less, the patch
    solved again from them, DIR replaced once all of it is written."""
    from ctxc.bake.chunks import find_chunk
    from ctxc.bake.statistics import STATS_FILE, Statistics
    from ctxc.patch import Patch

    stats = Statistics.load(folder / STATS_FILE)
    if chunk is not None:
        find_chunk(stats, chunk)  # one line before the model loads
    named = [(p.name, read_context(p)) for p in named_paths]
    with output_folder(folder, True, "bake") as tmp:
        from ctxc.bake.chunks import bake_chunks, remove_chunk

        before = Patch.load(folder)
        net, tokenizer = load(model, before.meta.dtype)
        before.check(net)
        with stage_progress("gathering", "statistics") as (on_stage, on_block):
            if chunk is not None:
                got = remove_chunk(net, stats, chunk, on_stage=on_stage, on_block=on_block)
            else:
                contexts = [(name, list(tokenizer(text).input_ids)) for name, text in named]
                got = bake_chunks(net, tokenizer, contexts, fit_texts, start=stats,
                                  on_stage=on_stage, on_block=on_block)  # fmt: skip
        seed = int(stats.options.get("seed", 0))
        lines = _write_chunks(net, tokenizer, got, tmp, kinds, held, eval_samples, seed)
    _say_all([*lines, f"wrote {folder}/"])


def _write_chunks(net, tokenizer, got, tmp: Path, kinds, held, eval_samples, seed) -> list[str]:
    """Write an additive bake's patch, statistics, artefacts and report; its summary lines
    (the figures are on the last chunk gathered; none after a removal)."""
    from ctxc.bake.driver import BakeResult
    from ctxc.bake.statistics import STATS_FILE
    from ctxc.core.report import write_report

    report = got.report
    held_chunks = ", ".join(f"{c['id']} ({c['name']})" for c in report["chunks"])
    lines = [f"chunks: {held_chunks}"]
    if got.data is not None:
        result = BakeResult(got.patch, got.data, None, report)
        report["figures"] = _figures(net, tokenizer, result, held, eval_samples, seed)
        report["figures_chunk"] = report["chunks"][-1]["id"]
        lines += _summary(report["figures"])
    got.patch.save(tmp / PATCH_FILE)
    got.stats.save(tmp / STATS_FILE)
    artefacts = _emit(net, tokenizer, got.patch, tmp, kinds)
    write_report(tmp, report, artefacts, under="artefacts")
    return lines


def _bake_options(rank: str, **fields) -> BakeOptions:
    """The command's options as :class:`BakeOptions`, validated here, once (the library names
    its fields, ``FLAGS`` the flags); ``--rank auto`` is each block's own rank."""
    return BakeOptions(
        rank=parse_rank(rank), rank_per_block=rank.strip().lower() == "auto", **fields
    )


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


def _baked_chat(folder: Path, tokenizer, context_ids: list[int]):
    """The :class:`~ctxc.bake.chat.ChatFormat` of a ``--chat`` bake (its report.json's
    ``chat.messages``), None for a plain one: its held-out queries are user turns."""
    path = folder / "report.json"
    try:
        chat = json.loads(path.read_text(encoding="utf-8")).get("chat")
    except (OSError, ValueError, AttributeError):
        return None
    if not chat:
        return None
    from ctxc.bake.chat import chat_format

    found = chat_format(tokenizer, chat["messages"])
    if found.context_ids != list(context_ids):
        raise CtxcError(f"{path}'s chat turns do not render to the patch's context ids")
    return found


def _held_out(queries: Path | None, questions: Path | None, samples: int) -> dict:
    """The held-out query and question files' lines (None where not given); ``samples``
    (``--eval-samples``) checked."""
    from ctxc.bake.data import read_queries

    if samples < 0:
        raise CtxcError(f"--eval-samples must be at least 0 (got {samples})")

    return {
        "held_out_queries": read_queries(queries) if queries else None,
        "held_out_questions": read_queries(questions) if questions else None,
    }


def _say_all(lines: list[str]) -> None:
    for line in lines:
        say(line)


def _figures(net, tokenizer, result, held: dict, eval_samples: int, seed: int) -> dict:
    """Fit-data (its first ``FIT_EVAL`` queries) and held-out figures of the patch beside the
    unpatched control's; held-out questions get the answer-agreement figure too."""
    from ctxc.bake.driver import bake_data
    from ctxc.bake.evaluate import evaluate_many
    from ctxc.bake.selfstudy import as_question

    data, chat = result.data, result.chat
    ids, prefix = data.context_ids, data.prefix

    def held_data(texts, samples: int, tokens: int, seed: int):
        """Held-out data as the fit's: plain text, or (chat) user turns, unanswered."""
        return bake_data(net, tokenizer, ids, texts, samples, tokens, seed, prefix, chat=chat)

    sets = {"fit": (data.part(0, FIT_EVAL), 0)}
    if eval_samples:
        sets["held_out_samples"] = (
            held_data(None, eval_samples, EVAL_TOKENS, seed + 1),
            EVAL_TOKENS,
        )
    if held["held_out_queries"]:
        sets["held_out_queries"] = (held_data(held["held_out_queries"], 0, 1, seed), EVAL_TOKENS)
    if held["held_out_questions"]:
        asked = held["held_out_questions"]  # chat: each question is the user's turn
        texts = asked if chat is not None else [as_question(q) for q in asked]
        sets["held_out_questions"] = (held_data(texts, 0, 1, seed), 24)
    figures = {}
    for name, (d, gen) in sets.items():
        stage(f"evaluating on {name}, {len(d.queries)} queries")
        tok = tokenizer if name == "held_out_questions" else None
        patched, control = evaluate_many(net, [result.patch, None], d, gen, tokenizer=tok)
        figures[name] = {"patched": patched.to_dict(), "control": control.to_dict()}
    return figures


def _emit(net, tokenizer, patch, tmp: Path, kinds: list[str]) -> dict:
    """The artefacts of ``kinds``, each checked as a compile's are (model/ reloaded too); their
    figures (at the first fit query) by kind."""
    from ctxc.backends import emit_checked

    return emit_checked(net, patch, tmp, kinds, on_stage=stage, tokenizer=tokenizer)


def _summary(figures: dict) -> list[str]:
    """A line per measured set, each figure of the patch beside the unpatched model's (named:
    ``free generation 3.5 tokens (unpatched 4.6)``), then a warning line for a set where the
    patch did worse than no patch (issue 34)."""
    lines = []
    for name, pair in figures.items():
        p, c = pair["patched"], pair["control"]
        gen = (
            f", free generation {p['matched']:.1f} tokens matched (unpatched {c['matched']:.1f})"
            if p["gen_tokens"]
            else ""
        )
        if p.get("answers") is not None:
            gen += f", answers {p['answers']:.0%} (unpatched {c['answers']:.0%})"
        lines.append(
            f"{name}: KL {p['kl']:.3g} (unpatched {c['kl']:.3g}), top-1 {p['top1']:.1%} "
            f"(unpatched {c['top1']:.1%}){gen}"
        )
        worse = _worse(p, c)
        if worse:
            lines.append(f"warning: {name}: the patch did worse than no patch on {worse}")
    return lines


def _worse(p: dict, c: dict) -> str:
    """The figures where the patch ``p`` did worse than the unpatched control ``c``, as text
    (empty when none): a higher KL, a lower top-1, fewer tokens matched, fewer answers."""
    worse = []
    if p["kl"] > c["kl"]:
        worse.append(f"KL ({p['kl']:.3g} > {c['kl']:.3g})")
    if p["top1"] < c["top1"]:
        worse.append(f"top-1 ({p['top1']:.1%} < {c['top1']:.1%})")
    if p["gen_tokens"] and p["matched"] < c["matched"]:
        worse.append(f"free generation ({p['matched']:.1f} < {c['matched']:.1f} tokens)")
    mine, theirs = p.get("answers"), c.get("answers")
    if mine is not None and theirs is not None and mine < theirs:
        worse.append(f"answers ({mine:.0%} < {theirs:.0%})")
    return ", ".join(worse)


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
    from ctxc.bake.data import read_queries
    from ctxc.patch import Patch

    texts = read_queries(queries) if queries is not None else None
    if not texts and samples < 1:
        raise CtxcError("give --queries FILE or --samples K (at least 1) to evaluate on")
    if gen_tokens < 0:
        raise CtxcError(f"--gen-tokens must be at least 0 (got {gen_tokens})")
    patch = Patch.load(folder)
    if not patch.meta.update.startswith("bake"):
        raise CtxcError(f"{folder} holds an exact compile's patch, not a baked one")
    from ctxc.bake.driver import bake_data
    from ctxc.bake.evaluate import evaluate_many

    net, tokenizer = load(model, patch.meta.dtype)
    patch.check(net)
    chat = _baked_chat(folder, tokenizer, patch.meta.context_ids)
    data = bake_data(
        net, tokenizer, patch.meta.context_ids, texts, max(samples, 0), 32, seed, chat=chat
    )
    stage(f"evaluating on {len(data.queries)} queries")
    patched, control = evaluate_many(net, [patch, None], data, gen_tokens)
    figures = {"held_out": {"patched": patched.to_dict(), "control": control.to_dict()}}
    for line in _summary(figures):
        say(line)
    say(json.dumps(figures))
