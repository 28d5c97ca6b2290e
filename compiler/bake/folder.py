"""A bake's folder: its figures measured, its patch, artefacts and report written; and a baked
folder measured again (``ctxc eval-bake``).

A bake folder holds ``patch.safetensors``, ``report.json`` (the bake's report with its figures
under ``figures`` and each artefact's check under ``artefacts``) and what ``emit`` asked for,
each checked as a compile's are (:func:`ctxc.backends.emit_checked`). The figures are the
patch's against the unpatched control's on the fit data's first :data:`FIT_EVAL` queries and
on held-out data (:class:`HeldOut`), in the fit's own form (plain text, or chat turns).
"""

from __future__ import annotations

import json
from pathlib import Path

from ctxc.bake.driver import BakeResult, bake_data
from ctxc.bake.hooks import BakeHooks, OnStage
from ctxc.bake.job import HeldOut
from ctxc.bake.scope import SCOPE_FILE, Scope, terms
from ctxc.core.errors import CtxcError, OptionError
from ctxc.core.report import REPORT_FILE, write_report
from ctxc.core.vocabulary import PATCH_FILE

__all__ = [
    "EVAL_TOKENS",
    "FIT_EVAL",
    "bake_scope",
    "baked_chat",
    "emit_baked",
    "evaluate_folder",
    "measure_figures",
    "save_scope",
    "summary_lines",
    "worse",
    "write_bake",
]

# The report's figures, kept within the default's time budget (docs/results/bake_defaults.md):
# held-out samples of EVAL_TOKENS tokens (greedy generation as long), the fit set's first
# FIT_EVAL queries.
EVAL_TOKENS = 16
FIT_EVAL = 8
# Greedy tokens of a held-out question's answer (its answer-agreement figure).
QUESTION_TOKENS = 24
# The off-topic set's seed, after the bake's (the fit's off-topic sources take + 2 to + 4).
_OFF_TOPIC_SEED = 5


def measure_figures(
    net,
    tokenizer,
    result: BakeResult,
    held: HeldOut,
    seed: int,
    on_stage: OnStage | None = None,
    scope: Scope | None = None,
) -> dict:
    """The patch's figures beside the unpatched control's: the fit data's first
    :data:`FIT_EVAL` queries and every held-out set (held-out questions get the
    answer-agreement figure too), the ``off_topic`` one included.

    Args:
        net, tokenizer: the unpatched model the patch was baked on.
        result: the bake.
        held: the held-out sets.
        seed: the bake's seed (held-out samples draw with ``seed + 1``).
        on_stage: called with each set's name before it is measured.
        scope: the scope the ``scoped`` figures are served with (None: the bake's context's,
            :func:`bake_scope`).

    Returns:
        set name -> ``{"patched": ..., "control": ...}`` (``BakeEval.to_dict``).
    """
    from ctxc.bake.selfstudy import as_question

    data, chat = result.data, result.chat
    ids, prefix = data.context_ids, data.prefix

    def held_data(texts, samples: int, tokens: int, seed: int):
        """Held-out data as the fit's: plain text, or (chat) user turns, unanswered."""
        return bake_data(net, tokenizer, ids, texts, samples, tokens, seed, prefix, chat=chat)

    sets = {"fit": (data.part(0, FIT_EVAL), 0)}
    if held.samples:
        sets["held_out_samples"] = (
            held_data(None, held.samples, EVAL_TOKENS, seed + 1),
            EVAL_TOKENS,
        )
    if held.queries:
        sets["held_out_queries"] = (held_data(list(held.queries), 0, 1, seed), EVAL_TOKENS)
    if held.questions:
        # Chat: each question is the user's turn; plain text: asked as self-study asks.
        texts = (
            list(held.questions) if chat is not None else [as_question(q) for q in held.questions]
        )
        sets["held_out_questions"] = (held_data(texts, 0, 1, seed), QUESTION_TOKENS)
    if held.off_topic:
        sets["off_topic"] = (
            _off_topic_set(net, tokenizer, result, held.off_topic, seed, held_data),
            0,
        )
    figures = {}
    gate = scope if scope is not None else bake_scope(tokenizer, result)
    for name, (d, gen) in sets.items():
        if on_stage is not None:
            on_stage(f"evaluating on {name}, {len(d.queries)} queries")
        answers = name == "held_out_questions"  # its answer-agreement figure
        figures[name] = _scoped_figures(net, tokenizer, result.patch, d, gen, gate, chat, answers)
    return figures


def _scoped_figures(net, tokenizer, patch, data, gen: int, gate: Scope, chat, answers: bool):
    """``{"patched", "control", "scoped"}`` figures of ``patch`` on ``data``: ``scoped`` with
    the patch on the queries ``gate`` admits (their decoded text, a chat template's words
    ignored) and the control elsewhere, with ``in_scope`` (how many)."""
    from ctxc.bake.evaluate import evaluate_scoped

    ignore = _template_words(tokenizer, chat)
    texts = [tokenizer.decode(q, skip_special_tokens=True) for q in data.queries]
    admitted = [gate.admits(t, ignore) for t in texts]
    tok = tokenizer if answers else None
    patched, control, scoped = evaluate_scoped(net, patch, data, admitted, gen, tok)
    return {
        "patched": patched.to_dict(),
        "control": control.to_dict(),
        "scoped": {**scoped.to_dict(), "in_scope": sum(admitted)},
    }


def bake_scope(tokenizer, result: BakeResult) -> Scope:
    """The scope of a bake's context (:mod:`ctxc.bake.scope`): the words of its text (a chat
    bake's context turns' contents), at the default threshold."""
    if result.chat is not None:
        return Scope.of("\n\n".join(str(t.get("content", "")) for t in result.chat.turns))
    return Scope.of(tokenizer.decode(result.data.context_ids, skip_special_tokens=True))


def _template_words(tokenizer, chat) -> frozenset[str]:
    """The words a chat template writes around a user turn (``user``, ``assistant``): not the
    user's, so not weighed by the scope. None for plain text."""
    if chat is None:
        return frozenset()
    probe = "scopeprobe"  # a turn must hold text; the probe's own word is dropped
    return terms(tokenizer.decode(chat.turn(probe), skip_special_tokens=True)) - {probe}


def _off_topic_set(net, tokenizer, result: BakeResult, count: int, seed: int, held_data):
    """The ``off_topic`` set: ``count`` continuations of ``EVAL_TOKENS`` tokens and ``count``
    questions, written by the model fed the prefix alone (what the patched model is fed first:
    BOS, or a chat template's opening), then fed after the context as the fit's queries are;
    measured by KL and top-1 only, in one evaluation (at 8 and 8, as two sets with the
    questions' greedy answers, they took the figures from 42 s to 93 s of CPU at one thread on a
    SQuAD paragraph; without the answers, 74 s).

    Raises:
        OptionError: a bake whose patched model is fed nothing first (nothing to write from).
    """
    import ctxc.bake.data as data
    import ctxc.bake.selfstudy as selfstudy
    from ctxc.store.model_writing import stored_writing

    prefix = list(result.data.prefix)
    if not prefix:
        raise OptionError("the off-topic figures sample from the prefix: this bake has none")
    off = seed + _OFF_TOPIC_SEED

    def write() -> dict[str, list[str]]:
        texts = [
            tokenizer.decode(ids, skip_special_tokens=True)
            for ids in data.sample_continuations(net, prefix, count, EVAL_TOKENS, off)
        ]
        # A model that writes no question from its BOS (a tiny random one) adds none.
        _, questions = selfstudy.self_study(
            net, tokenizer, prefix, count, answer_tokens=1, seed=off
        )
        return {"texts": texts, "questions": questions}

    # The same strings at every bake of this model and seed: stored (issue 55).
    asked = {"prefix": prefix, "count": count, "tokens": EVAL_TOKENS, "seed": off}
    asked["tokenizer"] = [type(tokenizer).__name__, len(tokenizer)]  # it decodes the texts
    got = stored_writing(net, {"off_topic": asked}, [data, selfstudy], write)
    questions = got["questions"]
    questions = (
        questions if result.chat is not None else [selfstudy.as_question(q) for q in questions]
    )
    return held_data(got["texts"] + questions, 0, 1, seed)


def write_bake(
    net, tokenizer, result: BakeResult, folder: Path, kinds, held: HeldOut, hooks: BakeHooks
) -> dict:
    """Write one bake's folder: its figures (in the report), the patch, the ``kinds``
    artefacts checked, ``report.json``.

    Args:
        net, tokenizer: the unpatched model the patch was baked on.
        result: the bake (its ``report`` gains ``figures``).
        folder: the (staging) folder to write into.
        kinds: the ``emit`` backends' names.
        held: what the figures are measured on.
        hooks: the stage's reporters.

    Returns:
        the report written (``figures`` and ``artefacts`` in it).

    Side effects:
        writes ``folder``; sets ``result.report["figures"]``.
    """
    report = result.report
    seed = int(report["options"]["seed"])
    gate = bake_scope(tokenizer, result)
    report["figures"] = measure_figures(
        net, tokenizer, result, held, seed, hooks.on_stage, scope=gate
    )
    save_scope(folder, report, gate)
    result.patch.save(folder / PATCH_FILE)
    artefacts = emit_baked(net, tokenizer, result.patch, folder, kinds, report, hooks)
    return write_report(folder, report, artefacts, under="artefacts")


def save_scope(folder: Path, report: dict, gate: Scope) -> None:
    """Write ``folder/scope.json`` (which requests the patch answers: ``ctxc route FOLDER
    --query TEXT``) and the report's ``scope`` entry.

    Side effects:
        writes the file; sets ``report["scope"]``.
    """
    report["scope"] = {"file": SCOPE_FILE, "threshold": gate.threshold, "words": len(gate.words)}
    gate.save(folder)


def emit_baked(net, tokenizer, patch, folder: Path, kinds, report: dict, hooks: BakeHooks) -> dict:
    """The artefacts of ``kinds``, each checked as a compile's are (model/ reloaded too);
    their figures (at the first fit query) by kind. An artefact that describes itself (a PEFT
    adapter's card) is given the bake's ``report``: its options and figures, so that it says
    it is fitted, not exact, and how well."""
    if not kinds:
        return {}
    from ctxc.backends import emit_checked

    return emit_checked(
        net,
        patch,
        folder,
        list(kinds),
        on_stage=hooks.on_stage,
        tokenizer=tokenizer,
        bake_report=report,
    )


def baked_chat(folder: Path, tokenizer, context_ids: list[int]):
    """The :class:`~ctxc.bake.chat.ChatFormat` of a chat bake (its report's ``chat.messages``),
    None for a plain one: its held-out queries are user turns.

    Raises:
        CtxcError: the report's turns do not render to the patch's context ids.
    """
    path = Path(folder) / REPORT_FILE
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


def evaluate_folder(
    folder: Path,
    queries: list[str] | None,
    samples: int,
    seed: int,
    gen_tokens: int,
    model: str | None = None,
    hooks: BakeHooks | None = None,
) -> dict:
    """A baked folder's patch measured on held-out queries against the model fed its context
    (``ctxc eval-bake``).

    Args:
        folder: a bake folder.
        queries: held-out query texts (user turns, for a chat bake), or None.
        samples: continuations to sample (seed ``seed``), at least 0.
        gen_tokens: greedy tokens per query, at least 0.
        model: the model the patch was baked on (None: the bundled one).
        hooks: the stage's reporters and model load.

    Returns:
        ``{"held_out": {"patched": ..., "control": ..., "scoped": ...}}`` (``scoped``: served
        with the folder's scope, when it has one).

    Raises:
        CtxcError: nothing to evaluate on, a bad count, an exact compile's patch, a patch of
            another model.
    """
    from ctxc.patch import Patch

    hooks = hooks or BakeHooks()
    if not queries and samples < 1:
        raise OptionError("give {queries} or {samples} (at least 1) to evaluate on")
    if gen_tokens < 0:
        raise OptionError("{gen_tokens} must be at least 0 (got {})", gen_tokens)
    patch = Patch.load(folder)
    if not patch.meta.baked:
        raise CtxcError(f"{folder} holds an exact compile's patch, not a baked one")
    from ctxc.bake.evaluate import evaluate_many

    net, tokenizer = hooks.load(model, patch.meta.dtype)
    patch.check(net)
    chat = baked_chat(folder, tokenizer, patch.meta.context_ids)
    data = bake_data(
        net, tokenizer, patch.meta.context_ids, queries, max(samples, 0), 32, seed, chat=chat
    )
    hooks.on_stage(f"evaluating on {len(data.queries)} queries")
    if not (Path(folder) / SCOPE_FILE).is_file():  # baked before scopes: the patch alone
        patched, control = evaluate_many(net, [patch, None], data, gen_tokens)
        return {"held_out": {"patched": patched.to_dict(), "control": control.to_dict()}}
    gate = Scope.load(folder)
    return {"held_out": _scoped_figures(net, tokenizer, patch, data, gen_tokens, gate, chat, False)}


def summary_lines(figures: dict) -> list[str]:
    """A line per measured set, each figure of the patch beside the unpatched model's (named:
    ``free generation 3.5 tokens (unpatched 4.6)``) and, where measured, the figures served
    with the bake's scope (the patch on the queries in scope, no patch on the others); then a
    warning line for a set where the patch did worse than no patch (issue 34), saying whether
    its scope keeps that harm away (issue 53)."""
    lines = []
    for name, pair in figures.items():
        p, c, s = pair["patched"], pair["control"], pair.get("scoped")
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
        if s is not None:
            lines.append(
                f"  served with its scope ({s['in_scope']} of {s['queries']} queries in scope): "
                f"KL {s['kl']:.3g}, top-1 {s['top1']:.1%}"
            )
        bad = worse(p, c)
        if bad:
            warn = f"warning: {name}: the patch did worse than no patch on {bad}"
            if s is not None:
                still = worse(s, c)
                warn += f"; with its scope, on {still}" if still else "; not with its scope"
            lines.append(warn)
    return lines


def worse(p: dict, c: dict) -> str:
    """The figures where the patch ``p`` did worse than the unpatched control ``c``, as text
    (empty when none): a higher KL, a lower top-1, fewer tokens matched, fewer answers."""
    found = []
    if p["kl"] > c["kl"]:
        found.append(f"KL ({p['kl']:.3g} > {c['kl']:.3g})")
    if p["top1"] < c["top1"]:
        found.append(f"top-1 ({p['top1']:.1%} < {c['top1']:.1%})")
    if p["gen_tokens"] and p["matched"] < c["matched"]:
        found.append(f"free generation ({p['matched']:.1f} < {c['matched']:.1f} tokens)")
    mine, theirs = p.get("answers"), c.get("answers")
    if mine is not None and theirs is not None and mine < theirs:
        found.append(f"answers ({mine:.0%} < {theirs:.0%})")
    return ", ".join(found)
