"""The library's options, typed and frozen, each validated once: when it is made.

:func:`ctxc.compile`, :func:`ctxc.generate.steps.generate` and :func:`ctxc.bake.driver.bake` take
these (or build one from their keyword arguments); every stage below them takes the values as
they are. A bad value is an :class:`~ctxc.core.errors.OptionError` naming the library's
parameter (``max_new_tokens``); the CLI, which makes these before it loads a model, prints the
parameter's flag instead (``compiler/cli/options.py``: ``FLAGS``). Torch-free.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import Field, dataclass, field, fields
from typing import Any

from ctxc.core.errors import OptionError
from ctxc.core.vocabulary import (
    ADDITIVE_METHOD,
    APPLY_MODES,
    BAKE_DATA,
    BAKE_METHODS,
    BOTH_DATA,
    CLOZE_FORMS,
    CLOZE_PHRASINGS,
    CLOZE_TEACHERS,
    CONTINUATIONS_DATA,
    DEFAULT_RULE,
    DISTILL_METHOD,
    DISTILL_PRECISIONS,
    FIT_METHOD,
    FIT_ROWS,
    OFF_TOPIC_TARGETS,
    ON_POLICY_REFITS,
    QUESTION_PROMPTS,
    RULES,
    SAMPLE_HEADS,
    SELF_STUDY_DATA,
    check_choice,
)

__all__ = [
    "BAKE_GROUPS",
    "DEFAULT_RANK",
    "BakeOptions",
    "CompileOptions",
    "GenerateOptions",
    "bake_fields",
    "block_slice",
]


def _at_least(param: str, value: object, low: int, got: bool = True) -> None:
    """Refuse a non-integer (a bool too) or one below ``low``, naming ``param`` (and the value
    given, unless ``got`` is False: the message ``ctxc generate`` has always printed)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionError("{" + param + "} must be an integer (got {!r})", value)
    if value < low:
        more = " (got {})" if got else ""
        raise OptionError("{" + param + "} must be at least {}" + more, low, value)


@dataclass(frozen=True)
class CompileOptions:
    """How :func:`ctxc.compile` compiles a context.

    Attributes:
        update: the update rule (``ctxc.core.vocabulary.RULE_MEANINGS``).
        start_layer: blocks with index below it stay unpatched (at least 0; the model bounds it
            above, checked once its blocks are found).
        skip_unpatchable: patch the patchable blocks when others are rejected (else an error).
        apply: ``baked`` or ``lowrank`` (``ctxc.core.vocabulary.APPLY_MODES``).

    Raises:
        OptionError: a bad value, naming its attribute.
    """

    update: str = DEFAULT_RULE
    start_layer: int = 0
    skip_unpatchable: bool = False
    apply: str = "baked"

    def __post_init__(self) -> None:
        check_choice("update", self.update, RULES, "update rule")
        check_choice("apply", self.apply, APPLY_MODES, "apply mode")
        _at_least("start_layer", self.start_layer, 0)


@dataclass(frozen=True)
class GenerateOptions:
    """How ``generate`` runs the paper's per-token protocol.

    Attributes:
        max_new_tokens: steps to run (at least 1).
        update: the update rule.
        apply: ``lowrank`` (the default: the cheap in-memory form) or ``baked``.

    Raises:
        OptionError: a bad value, naming its attribute.
    """

    max_new_tokens: int = 20
    update: str = DEFAULT_RULE
    apply: str = "lowrank"

    def __post_init__(self) -> None:
        _at_least("max_new_tokens", self.max_new_tokens, 1, got=False)
        check_choice("update", self.update, RULES, "update rule")
        check_choice("apply", self.apply, APPLY_MODES, "apply mode")


# The groups of ``BakeOptions``' fields, in the order ``ctxc bake --help`` shows them (a panel
# each); a field without a flag is library-only (``LIBRARY_ONLY``).
BAKE_GROUPS: dict[str, str] = {
    "data": "Fit data",
    "fit": "Fit",
    "distill": "Distill (method distill)",
    "serving": "Serving",
}
# The rank a bake gives every matrix when none is asked for: R = 64 was as good as full rank in
# issue 13's table, and cheaper to apply (docs/results/bake_defaults.md).
DEFAULT_RANK = 64


def _option(default: Any, group: str, flag: str | None, help: str, **more: Any) -> Any:
    """A ``BakeOptions`` field: its default once, its group, and the flag and help text
    ``ctxc bake`` builds its option from (``flag`` None: library-only). ``more``: ``choices``
    (the vocabulary's dict), ``negative`` (a ``--no-`` form for a tri-state bool)."""
    return field(default=default, metadata={"group": group, "flag": flag, "help": help, **more})


def block_slice(spec: str) -> slice:
    """A ``start:stop`` spec of blocks (``BakeOptions.moved_blocks``) as a slice; ``""``: all.

    Raises:
        ValueError: a spec that is not ``start:stop`` of integers (either may be left out).
    """
    if not spec:
        return slice(None)
    parts = spec.split(":")
    ok = len(parts) == 2 and all(not p.strip() or p.strip().lstrip("-").isdigit() for p in parts)
    if not ok:
        raise ValueError(f"{spec!r} is not start:stop (block indices, e.g. 9: or 4:14)")
    start, stop = (int(p) if p.strip() else None for p in parts)
    return slice(start, stop)


@dataclass(frozen=True)
class BakeOptions:
    """How a thought patch is made (``ctxc.bake.driver.bake``), one field per decision: its
    default, its flag and its help text are declared here once (``compiler/cli/bake.py`` builds
    ``ctxc bake``'s options from them).

    Attributes:
        data: what the fit data are besides the query file (``ctxc.core.vocabulary.BAKE_DATA``):
            ``continuations`` (``samples`` of ``sample_tokens``), ``self-study`` (``questions``
            the model writes about the context, each with its greedy answer of
            ``answer_tokens``; ``ctxc.bake.selfstudy``) or ``both``. The defaults (``both``: 16
            samples of 16 tokens and 16 self-study questions with 16 answer tokens, rank 64)
            are the table's best of those within the time goal
            (docs/results/bake_defaults.md).
        samples: K, continuations sampled from the model fed the context (at least 0).
        sample_tokens: tokens per sampled continuation (at least 1).
        questions: self-study questions (at least 0; used by ``self-study`` and ``both``).
        answer_tokens: greedy answer tokens per self-study question (at least 1).
        question_temperature: the sampling temperature of the questions (answers are greedy).
        sample_head: library-only: the output head the sampling decode loops (self-study
            questions, samples) read (``SAMPLE_HEADS``): ``float32``, the model's own; or
            ``bfloat16``, with each row's top 8 logits exact (``ctxc.runs.shortlist_head``):
            the fit data 0.65x the time, but other draws (about 3% of tokens differ), read as
            a new seed reads (docs/bake.md, issue 55). Greedy loops (answers) always read the
            bfloat16 head: their picks are the float32 head's.
        cloze: extractive self-study queries besides ``questions`` (at least 0;
            ``ctxc.bake.cloze``): a sentence of the context with one of its names or numbers
            replaced by a wh-word is the question, that span of the context the answer.
            Evenly spaced over the text's names and numbers, all of them when it has fewer; in
            a chat bake the question is the user's turn after the context turns. Default 64: on
            SQuAD paragraphs the patch keeps 0.68 of the F1 the context adds with them, 0.35
            without (30 paragraphs, issue 35; docs/bake.md, "Measured").
        cloze_form: how a cloze question is cut (``CLOZE_FORMS``): ``sentence`` (the
            sentence's words before the span, then its clause after it), ``clause`` (the
            span's clause alone) or ``both`` (each span asked both ways).
        cloze_phrasings: how many wordings the cloze questions are asked in, round-robin
            over the rows (``CLOZE_PHRASINGS``; 1: ctxc's own ``Question: ...\nAnswer:``
            only). The rows stay ``cloze``, so the bake costs the same (issue 53).
        off_topic: off-topic rows (at least 0; ``ctxc.bake.sources.offtopic``): continuations
            of ``sample_tokens`` the model samples from its BOS alone (no context), their
            targets the full-context model's, so the patch is fitted to do off the context
            what the model reading the context does (issue 53; measured:
            ``benchmarks/thought/noharm.py``). Default 0 until the no-harm benchmark says.
        off_topic_questions: off-topic questions (at least 0): questions the model writes from
            its BOS alone, each answered by the full-context model, fitted likewise.
        off_topic_targets: (issue 53, measured on ``benchmarks/thought/noharm.py``):
            what every off-topic row is fitted to (``OFF_TOPIC_TARGETS``): ``context``, the
            full-context model's values on context + row; ``none``, the unpatched model's own
            on the row alone (:func:`~ctxc.bake.targets.own_targets`; a distillation's
            teacher there likewise, :func:`~ctxc.bake.distill.own_teacher`), so the patch is held to
            change nothing off the context instead of reproducing what reading the context
            does there (a target that asks for capacity: the model fed a paragraph answers
            fewer general questions than alone).
        seed: the sampling (and training) seed.
        question_prompt: library-only (``facts`` was within noise of ``plain``): how the model
            is asked to write a self-study question after the context
            (``ctxc.bake.selfstudy.QUESTION_PROMPTS``): ``plain`` (`` Question: <wh>``) or
            ``facts`` (a line asking for questions answered by a name, number, date or short
            phrase from the text, then ``Question: <wh>``).
        topics: library-only (they scored below no context): topic questions besides
            ``questions``, ``What does the text say about <X>?`` for the first ``topics``
            names and numbers the context mentions (``ctxc.bake.selfstudy.topics``).
        cloze_teacher: whose reading gives a cloze query's targets (``CLOZE_TEACHERS``):
            ``shown`` (the default, and the command's only one), the full-context model after
            it has read the question and its span once (the cloze query put before itself), so
            its targets give the span where its own reading of the context gives another
            answer (Gemma 3 270M gives the span for 3 of 16 cloze questions on the Normans
            paragraph, 14 of 16 shown); ``plain`` (library-only), the same model reading the
            question after the context alone. On SQuAD paragraphs the patch keeps 1.08 of the
            F1 the context adds with ``shown``, 0.68 with ``plain`` (30 paragraphs, issue 35;
            docs/bake.md, "Measured").
        fit_rows: library-only (``answers`` kept 0.30 against 0.34): which positions of a
            self-study query are fitted (``FIT_ROWS``): ``all`` or ``answers`` (from the one
            that predicts the answer's first token: the question's own positions are run, not
            fitted).
        method: ``fit``, ``distill`` or ``additive`` (``ctxc.core.vocabulary.BAKE_METHODS``;
            distill needs peft installed).
        rank: rank budget per matrix (at least 1; the model bounds it above); None: no budget.
        rank_per_block: each block's matrices at its measured effective rank (rounded up),
            at most ``rank`` (``fit`` only; ``FitOptions.rank_per_block``; ``--rank auto``).
        ridge: relative ridge of the matrix fits
            (:class:`~ctxc.passes.solver.fit_moves.FitOptions`); among 0.05-5, 1.0 was best
            held out on the hand-written questions and within 0.02 of 5 on fresh samples
            (docs/results/thought_patches.md, levers).
        attention: move the attention output projections too (and their post-norm scales, in
            ``fit``; a LoRA on them, in ``distill``) where a block has that surface (sandwich
            norms: Gemma 2/3, OLMo 2). None: wherever the model has it; True: the same, and a
            model with none refuses it; False: the MLPs only.
        on_policy: ``fit``: fit a second time with on-policy rows (``ctxc.bake.onpolicy``):
            each fitted question answered by the first fit's patched model, that answer read by
            the full-context model. None (default): in a chat bake, where it was measured
            (SmolLM2-135M-Instruct, 10 SQuAD paragraphs: the baked answers that looped, 2 of
            61, loop no more; issue 35, docs/bake.md), not in plain text; True or False: always
            or never.
        on_policy_refit: library-only: how the on-policy rows refit (``ON_POLICY_REFITS``):
            ``all``, a second fit over the first fit's rows and the new ones; ``new``, a
            refit pass (:func:`~ctxc.passes.solver.fit_solve.fit_solve`'s ``start``) over the
            on-policy answers' positions alone, on top of the first fit: the stage about 2.5x
            cheaper, but kept 0.72 against 0.94 and a loop back (SmolLM2 chat, 10 paragraphs;
            docs/bake.md); ``answers``, the second fit over every row with the on-policy
            rows' question positions run, not fitted (they repeat the first rows exactly): the
            stage 20-40% cheaper on 2 paragraphs, reading as the default's there.
        refit_passes: library-only (0.60 against 1.01 kept): refit passes after the first fit
            (at least 0): each runs the queries again with the patch so far and fits every
            block's remaining error on top of it
            (:func:`~ctxc.passes.solver.fit_solve.fit_solve`).
        prior: library-only (issue 53, measured on ``benchmarks/thought/noharm.py``): the share
            (0 to 1) of the second moment of each moved linear's inputs, on the model's own
            text from its prefix alone, in the metric of that linear's ridge
            (``ctxc.bake.prior``: MEMIT's covariance term), so a move is charged by what it
            changes off the context; 0 (default): the plain ridge.
        moved_blocks: library-only (issue 53): which blocks the fit moves, a Python slice over
            their indices (``"9:"``: the tenth block on); the others are run, not moved
            (``FitOptions.moved_blocks``). ``""`` (default): every block.
        scale_ridge: library-only: relative ridge of the post-norm scale fit (0.1: best among
            0.01-1).
        fit_prefix: library-only: the prefix positions (BOS, matched to the context's last
            token) are constraints too; False (default): they are run but not fitted. The BOS
            position is the same in every query (K identical rows of a very large norm):
            fitted, it dominated the least squares and held-out KL on fresh samples was 0.71
            against 0.32 unfitted (unpatched 1.02; factsheet, K=32, R=64;
            docs/results/thought_patches.md, levers).
        input_moves: library-only: fit the inner linears' input moves too; False: the output
            move only.
        distill_steps: optimiser steps of ``distill`` (at least 1).
        distill_seconds: a wall-time budget for ``distill`` instead of ``distill_steps`` (the
            training loop's time; the report gives the steps reached). None: the step count.
        distill_lr: its learning rate; None: 1e-3 from scratch, 1e-4 from the fit (at 1e-3
            the first steps undo the fit: held-out KL 0.34x of the unpatched model's against
            the fit's own 0.29x; at 1e-4, 0.21x; docs/results/bake_defaults.md).
        distill_from_fit: start the LoRA from the fit's patch (truncated to ``rank``).
        distill_precision: library-only: ``distill``'s training runs (``DISTILL_PRECISIONS``):
            ``bfloat16``, the output head's product in bfloat16 (0.67x a step's time on
            Gemma 3 270M, its 262,144-token head; the rest float32), or ``float32``.
        linear_only: ``fit``: move linear weights only, no post-norm scale (a serving LoRA
            holds no norm weight: vLLM and llama.cpp refuse them); the output move is the
            outer linear's alone. ``additive`` is linear-only whatever this says.

    Raises:
        OptionError: a bad value, or an option of another method than ``method``, naming its
            attribute.
    """

    data: str = _option(
        BOTH_DATA,
        "data",
        "--data",
        "Fit data: continuations, self-study or both.",
        choices=BAKE_DATA,
    )
    samples: int = _option(16, "data", "--samples", "K continuations sampled to fit on.")
    sample_tokens: int = _option(16, "data", "--sample-tokens", "Tokens per sample.")
    questions: int = _option(16, "data", "--questions", "Self-study questions the model writes.")
    answer_tokens: int = _option(
        16, "data", "--answer-tokens", "Greedy tokens per self-study answer."
    )
    question_temperature: float = _option(
        1.0, "data", "--question-temperature", "Sampling temperature of the self-study questions."
    )
    cloze: int = _option(
        64,
        "data",
        "--cloze",
        "Extractive questions: a sentence of the context asking for one of its names or "
        "numbers, answered by that span.",
    )
    cloze_form: str = _option(
        "sentence",
        "data",
        "--cloze-form",
        "How a cloze question is cut: sentence, clause, or both (each span asked both ways).",
        choices=CLOZE_FORMS,
    )
    cloze_phrasings: int = _option(
        1,
        "data",
        "--cloze-phrasings",
        f"Wordings the cloze questions are asked in, round-robin (1 to {len(CLOZE_PHRASINGS)}; "
        "1: ctxc's own).",
    )
    off_topic: int = _option(
        0,
        "data",
        "--off-topic",
        "Off-topic rows: continuations the model samples from its BOS alone, fitted to the model "
        "reading the context (the patch held to the context's effect off the context).",
    )
    off_topic_questions: int = _option(
        0,
        "data",
        "--off-topic-questions",
        "Off-topic questions: questions the model writes from its BOS alone, answered by the "
        "model reading the context, fitted so.",
    )
    off_topic_reading: int = _option(
        0,
        "data",
        "--off-topic-reading",
        "Off-topic readings: a text the model samples from its BOS alone and a question it writes "
        "about it, answered by the model reading the context first (another document read well).",
    )
    off_topic_tokens: int = _option(
        16, "data", "--off-topic-tokens", "Tokens per off-topic sample and reading text."
    )
    seed: int = _option(0, "data", "--seed", "Sampling and training seed.")
    question_prompt: str = _option("plain", "data", None, "", choices=QUESTION_PROMPTS)
    topics: int = _option(0, "data", None, "")
    cloze_teacher: str = _option("shown", "data", None, "", choices=CLOZE_TEACHERS)
    fit_rows: str = _option("all", "data", None, "", choices=FIT_ROWS)
    method: str = _option(
        FIT_METHOD,
        "fit",
        "--method",
        "fit (closed form), distill (a trained LoRA, servable: --emit lora) or additive (chunks "
        "that add and remove).",
        choices=BAKE_METHODS,
    )
    rank: int | None = _option(
        DEFAULT_RANK,
        "fit",
        "--rank",
        "Rank budget per matrix, 'full', or 'auto' (each block's own).",
    )
    rank_per_block: bool = _option(False, "fit", None, "")  # the command's --rank auto
    ridge: float = _option(1.0, "fit", "--ridge", "Relative ridge of the matrix fits.")
    off_topic_targets: str = _option(
        "context",
        "data",
        "--off-topic-targets",
        "What off-topic rows are fitted or distilled to: context (the model reading the context) "
        "or none (the model alone: the patch held to change nothing there).",
        choices=OFF_TOPIC_TARGETS,
    )
    off_topic_weight: float = _option(
        1.0,
        "fit",
        "--off-topic-weight",
        "Weight of each off-topic row's positions in the fit or distillation (2: as if each were "
        "there twice).",
    )
    attention: bool | None = _option(
        None,
        "fit",
        "--attention",
        "Move the attention output projections too (sandwich-norm blocks: Gemma 2/3, OLMo 2). "
        "Default: where the model has them; --attention refuses a model without.",
        negative="--no-attention",
    )
    on_policy: bool | None = _option(
        None,
        "fit",
        "--on-policy",
        "fit: fit again with the patched model's own answers, read by the full-context model. "
        "Default: in a chat bake (--chat), not in plain text.",
        negative="--no-on-policy",
    )
    on_policy_refit: str = _option("all", "fit", None, "", choices=ON_POLICY_REFITS)
    sample_head: str = _option("float32", "data", None, "", choices=SAMPLE_HEADS)
    refit_passes: int = _option(0, "fit", None, "")
    prior: float = _option(0.0, "fit", None, "")
    moved_blocks: str = _option("", "fit", None, "")
    scale_ridge: float = _option(0.1, "fit", None, "")
    fit_prefix: bool = _option(False, "fit", None, "")
    input_moves: bool = _option(True, "fit", None, "")
    distill_steps: int = _option(200, "distill", "--steps", "Optimiser steps.")
    distill_seconds: float | None = _option(
        None, "distill", "--seconds", "Train for this wall time instead of --steps."
    )
    distill_lr: float | None = _option(
        None, "distill", "--lr", "Learning rate (1e-3; 1e-4 with --from-fit)."
    )
    distill_from_fit: bool = _option(False, "distill", "--from-fit", "Start from the fit.")
    distill_precision: str = _option("bfloat16", "distill", None, "", choices=DISTILL_PRECISIONS)
    linear_only: bool = _option(
        False,
        "serving",
        "--linear-only",
        "fit: move linear weights only, no norm scale (servable: --emit lora,gguf-lora).",
    )

    def _check_fit_levers(self) -> None:
        """The library-only levers of the fit's blocks and ridge (issue 53)."""
        try:
            block_slice(self.moved_blocks)
        except ValueError as exc:
            raise OptionError("{moved_blocks}: {}", exc) from exc
        if self.moved_blocks and self.method != FIT_METHOD:
            raise OptionError("{moved_blocks} picks the fit's blocks: it needs {method} fit")
        if not 0.0 <= self.prior <= 1.0:
            raise OptionError("{prior} must be between 0 and 1 (got {})", self.prior)
        if self.prior and self.method != FIT_METHOD:
            raise OptionError("{prior} is the fit's ridge metric: it needs {method} fit")

    def _check_choices(self) -> None:
        """The options that name one of a vocabulary's choices (``ctxc.core.vocabulary``)."""
        check_choice("cloze_form", self.cloze_form, CLOZE_FORMS, "cloze form")
        check_choice("cloze_teacher", self.cloze_teacher, CLOZE_TEACHERS, "cloze teacher")
        check_choice("fit_rows", self.fit_rows, FIT_ROWS, "fit rows")
        targets = self.off_topic_targets
        check_choice("off_topic_targets", targets, OFF_TOPIC_TARGETS, "off-topic target")
        check_choice("on_policy_refit", self.on_policy_refit, ON_POLICY_REFITS, "on-policy refit")
        check_choice("sample_head", self.sample_head, SAMPLE_HEADS, "sample head")
        check_choice(
            "distill_precision", self.distill_precision, DISTILL_PRECISIONS, "distill precision"
        )
        check_choice("question_prompt", self.question_prompt, QUESTION_PROMPTS, "question prompt")

    def __post_init__(self) -> None:
        _at_least("samples", self.samples, 0)
        _at_least("topics", self.topics, 0)
        _at_least("cloze", self.cloze, 0)
        _at_least("cloze_phrasings", self.cloze_phrasings, 1)
        if self.cloze_phrasings > len(CLOZE_PHRASINGS):
            raise OptionError(
                "{cloze_phrasings} must be at most {} (got {})",
                len(CLOZE_PHRASINGS),
                self.cloze_phrasings,
            )
        _at_least("off_topic", self.off_topic, 0)
        _at_least("off_topic_questions", self.off_topic_questions, 0)
        _at_least("off_topic_reading", self.off_topic_reading, 0)
        _at_least("off_topic_tokens", self.off_topic_tokens, 1)
        if not self.off_topic_weight > 0:
            raise OptionError("{off_topic_weight} must be above 0 (got {})", self.off_topic_weight)
        self._check_choices()
        if not self.question_temperature > 0:
            raise OptionError(
                "{question_temperature} must be positive (got {})", self.question_temperature
            )
        _at_least("refit_passes", self.refit_passes, 0)
        _at_least("questions", self.questions, 0)
        _at_least("answer_tokens", self.answer_tokens, 1)
        check_choice("data", self.data, BAKE_DATA, "fit data kind")
        _at_least("sample_tokens", self.sample_tokens, 1)
        if self.rank is not None:
            _at_least("rank", self.rank, 1)
        check_choice("method", self.method, BAKE_METHODS, "method")
        _at_least("distill_steps", self.distill_steps, 1)
        if self.distill_lr is not None and not self.distill_lr > 0:
            raise OptionError("{distill_lr} must be positive (got {})", self.distill_lr)
        if self.distill_seconds is not None and not self.distill_seconds > 0:
            raise OptionError("{distill_seconds} must be positive (got {})", self.distill_seconds)
        if self.rank_per_block and self.method != FIT_METHOD:
            raise OptionError("{rank_per_block} is for {method} fit: a LoRA has one rank")
        if self.method == ADDITIVE_METHOD and (self.refit_passes or self.rank_per_block):
            what = "{refit_passes}" if self.refit_passes else "{rank_per_block}"
            raise OptionError(
                what + " is not additive (it depends on the whole patch): use {method} fit"
            )
        if self.on_policy and self.method != FIT_METHOD:
            raise OptionError("{on_policy} refits the fit: it needs {method} fit")
        self._check_fit_levers()
        if self.off_topic_weight != 1.0 and self.method not in (FIT_METHOD, DISTILL_METHOD):
            raise OptionError(
                "{off_topic_weight} weighs the fit's or distillation's rows: it needs {method} "
                "fit or distill"
            )
        if self.method != DISTILL_METHOD:
            # A distill option beside another method would be ignored: one line, not a bake
            # that runs without it (``--steps 5 --seconds 3`` ran a 548 s fit, issue 52).
            moved = [f.name for f in bake_fields("distill") if _moved(self, f)]
            if moved:
                raise OptionError(
                    "{" + moved[0] + "} is for {method} distill (not {})", self.method
                )
        if self.method == DISTILL_METHOD and importlib.util.find_spec("peft") is None:
            raise OptionError("{method} distill needs peft: pip install 'ctxc[peft]'")

    def check_fit(self, queries: Sequence[str] | None) -> None:
        """Refuse a bake with nothing to fit on: no query text and ``samples`` 0.

        Raises:
            OptionError: naming ``samples`` and ``queries``.
        """
        if self.sampled or self.asked or self.topical or self.clozed or queries:
            return
        # topics is library-only and 0 here (else there would be questions): not named.
        asked = "{questions} 0 and {cloze} 0"
        zero = {CONTINUATIONS_DATA: "{samples} 0", SELF_STUDY_DATA: asked}
        raise OptionError(
            zero.get(self.data, "{samples} 0 and " + asked)
            + " and no {queries}: nothing to fit the patch on"
        )

    def on_policy_for(self, chat: bool) -> bool:
        """Whether a bake (a chat one when ``chat``) refits with on-policy rows."""
        return chat if self.on_policy is None else self.on_policy

    @property
    def sampled(self) -> int:
        """Continuations to sample: ``samples`` unless ``data`` is ``self-study``."""
        return 0 if self.data == SELF_STUDY_DATA else self.samples

    @property
    def topical(self) -> int:
        """Topic questions: ``topics`` unless ``data`` is ``continuations``."""
        return 0 if self.data == CONTINUATIONS_DATA else self.topics

    @property
    def clozed(self) -> int:
        """Extractive queries: ``cloze`` unless ``data`` is ``continuations``."""
        return 0 if self.data == CONTINUATIONS_DATA else self.cloze

    @property
    def moves_attention(self) -> bool:
        """Whether the attention output projections are moved where a block has them."""
        return self.attention is not False

    @property
    def lr(self) -> float:
        """``distill``'s learning rate (``distill_lr``, else by where it starts)."""
        if self.distill_lr is not None:
            return self.distill_lr
        return 1e-4 if self.distill_from_fit else 1e-3

    @property
    def asked(self) -> int:
        """Self-study questions: ``questions`` unless ``data`` is ``continuations``."""
        return 0 if self.data == CONTINUATIONS_DATA else self.questions


def bake_fields(group: str | None = None) -> list[Field]:
    """``BakeOptions``' fields in declaration order (those of ``group`` only, if given); each
    field's ``metadata`` holds its ``group``, ``flag`` (None: library-only) and ``help``."""
    return [f for f in fields(BakeOptions) if group is None or f.metadata["group"] == group]


def _moved(options: BakeOptions, f: Field) -> bool:
    """Whether ``options`` sets field ``f`` to other than its default."""
    return bool(getattr(options, f.name) != f.default)
