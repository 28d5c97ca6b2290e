"""The choices ctxc offers, named once: update rules, dtypes, GGUF types, formats (and the names
of the files a patch and its report are saved as); the backends declare themselves
(``backends/base.py``).

Each choice is a name and a one-line meaning, in the order the help lists them. The CLI builds its
option choices from here (``compiler/cli/options.py``); the library validates a value against
them once, where it enters (:func:`check_choice`, called by ``CompileOptions`` and the other
options types), and every stage below takes the validated value. Torch-free: ``ctxc --help``
reads it.
"""

from __future__ import annotations

from collections.abc import Iterable

from ctxc.core.errors import OptionError

__all__ = [
    "ADDITIVE_METHOD",
    "APPLY_MODES",
    "BAKE_DATA",
    "BAKE_METHODS",
    "BOTH_DATA",
    "CLOZE_FORMS",
    "CLOZE_KIND",
    "CLOZE_PHRASINGS",
    "CLOZE_TEACHERS",
    "CLOZE_TURN_PHRASINGS",
    "CONTINUATIONS_DATA",
    "DEFAULT_RULE",
    "DISTILL_METHOD",
    "DISTILL_PRECISIONS",
    "DTYPES",
    "EXACT_RULES",
    "FILE_KIND",
    "FIT_METHOD",
    "FIT_ROWS",
    "FORMATS",
    "GGUF_F32",
    "GGUF_TYPES",
    "LORA_RULE",
    "OFF_TOPIC_KINDS",
    "OFF_TOPIC_QUESTION_KIND",
    "OFF_TOPIC_READING_KIND",
    "OFF_TOPIC_TARGETS",
    "OFF_TOPIC_TEXT_KIND",
    "ON_POLICY_KIND",
    "OUTPUT_RULE",
    "PATCH_FILE",
    "QUESTION_PROMPTS",
    "REPORT_FILE",
    "RULES",
    "RULE_MEANINGS",
    "SAMPLE_KIND",
    "SELF_STUDY_DATA",
    "SELF_STUDY_KIND",
    "STABLE_RULE",
    "STANDARD_RULE",
    "check_choice",
    "choices_help",
]

# The update rules, in the solver's order (MATH.md 1, 4; issue 14); code compares a rule with
# these names, never with a literal.
STANDARD_RULE = "standard"
STABLE_RULE = "stable"
OUTPUT_RULE = "output"
LORA_RULE = "lora"
RULE_MEANINGS: dict[str, str] = {
    STANDARD_RULE: "the paper's rule: move the inner input, then the output (Theorem 1)",
    STABLE_RULE: (
        "standard, but a post norm's scale is reached through the outer linear (MATH.md 4)"
    ),
    OUTPUT_RULE: "no input move: the outer function absorbs the whole difference",
    LORA_RULE: (
        "linear weights only, as serving LoRA adapters hold them (exact without a post norm)"
    ),
}
RULES: tuple[str, ...] = tuple(RULE_MEANINGS)
# The rule a compile uses when none is given (``--update``, ``update=``).
DEFAULT_RULE = STABLE_RULE
# The rules whose patch is exact wherever they apply (lora is not behind a post norm).
EXACT_RULES: tuple[str, ...] = (STANDARD_RULE, STABLE_RULE, OUTPUT_RULE)

# The file a patch is saved as in an output folder (``ctxc compile``, ``bake``, ``--contexts``).
PATCH_FILE = "patch.safetensors"
# The file its figures are written to beside it (``ctxc.core.report.write_report``).
REPORT_FILE = "report.json"

# How a patch's deltas are applied in memory (MATH.md 6).
APPLY_MODES: dict[str, str] = {
    "baked": "the patched weights in the model's dtype, as the torch backend writes them",
    "lowrank": "each delta as a float32 action beside the unchanged weights (in memory only)",
}

DTYPES: dict[str, str] = {
    "float32": "exact to rounding (the default)",
    "bfloat16": "half the memory; rounding of about 1e-2",
    "float16": "half the memory; a narrower range than bfloat16",
}

# GGUF matrix types of the patched weights (``--gguf-type``). F32 rounds nothing: the default, and
# the one type the GGUF checks bound (F16 and BF16 files are reported).
GGUF_F32 = "F32"
GGUF_TYPES: dict[str, str] = {
    GGUF_F32: "float32 matrices (exact)",
    "F16": "float16 matrices",
    "BF16": "bfloat16 matrices",
}

# ``ctxc inspect --format``.
FORMATS: dict[str, str] = {
    "text": "a table per block",
    "json": "the analysis as JSON",
    "html": "a page with a diagram per block shape",
}

# How ``ctxc bake`` makes a thought patch (issue 13); code compares a method with these names.
FIT_METHOD = "fit"
DISTILL_METHOD = "distill"
ADDITIVE_METHOD = "additive"
BAKE_METHODS: dict[str, str] = {
    FIT_METHOD: "closed-form least squares over every fit position",
    DISTILL_METHOD: "a LoRA trained by context distillation (needs peft)",
    ADDITIVE_METHOD: "linear moves from sums over teacher-forced runs: chunks add and remove",
}

# What ``ctxc bake`` fits on (issue 25); code compares ``data`` with these names.
CONTINUATIONS_DATA = "continuations"
SELF_STUDY_DATA = "self-study"
BOTH_DATA = "both"
BAKE_DATA: dict[str, str] = {
    CONTINUATIONS_DATA: "continuations sampled from the model fed the context",
    SELF_STUDY_DATA: "questions the model writes about the context, answered with it in view",
    BOTH_DATA: "self-study questions and continuations",
}

# Where each of a bake's fit queries came from (``FitData.kinds``; counted in the report's
# ``fit_kinds``): a line of the query file, a self-study question and its answer, a cloze
# question and its span, a sampled continuation, a fitted question answered by the first fit's
# patched model (``ctxc.bake.onpolicy``).
FILE_KIND = "file"
SELF_STUDY_KIND = "self-study"
CLOZE_KIND = "cloze"
SAMPLE_KIND = "sample"
ON_POLICY_KIND = "on-policy"
# Rows the model writes without the context, fitted to the model reading it (issue 53).
OFF_TOPIC_TEXT_KIND = "off-topic-text"
OFF_TOPIC_QUESTION_KIND = "off-topic-question"
OFF_TOPIC_READING_KIND = "off-topic-reading"
# The kinds ``--off-topic-weight`` weighs (an on-policy row asked again is ``on-policy``).
OFF_TOPIC_KINDS = (OFF_TOPIC_TEXT_KIND, OFF_TOPIC_QUESTION_KIND, OFF_TOPIC_READING_KIND)

# What an off-topic row is fitted to (``BakeOptions.off_topic_targets``, issue 53).
OFF_TOPIC_TARGETS: dict[str, str] = {
    "context": "the full-context model's values on context + row (it does what reading does)",
    "none": "the unpatched model's own values on the row alone (the patch changes nothing there)",
}
# How the on-policy rows refit a bake (``BakeOptions.on_policy_refit``, issue 55).
ON_POLICY_REFITS: dict[str, str] = {
    "all": "a second fit over the first fit's rows and the on-policy rows",
    "new": "a refit pass over the on-policy answers alone, on top of the first fit",
    "answers": "a second fit over the first fit's rows and the on-policy rows' answers",
}
# The output head a bake's sampling decode loops read (``BakeOptions.sample_head``, issue 55).
SAMPLE_HEADS: dict[str, str] = {
    "float32": "the model's own head: the same draws as the model's",
    "bfloat16": "bfloat16 with each row's top exact (compiler/runs/shortlist_head.py): other draws",
}
# The precision of ``distill``'s training runs (``BakeOptions.distill_precision``, issue 54).
DISTILL_PRECISIONS: dict[str, str] = {
    "float32": "the model's own float32 forward and backward",
    "bfloat16": "the output head's product in bfloat16, forward and backward (the rest float32)",
}
# Which positions of a self-study query ``ctxc bake`` fits (issue 35).
FIT_ROWS: dict[str, str] = {
    "all": "every position of the question and its answer",
    "answers": "the answer's positions (and the one predicting its first token)",
}

# How ``ctxc bake --cloze`` cuts an extractive question from its sentence (issue 35).
CLOZE_TEACHERS: dict[str, str] = {
    "plain": "the full-context model reads the question after the context",
    "shown": "it reads the question and its answer once, then the question again",
}
CLOZE_FORMS: dict[str, str] = {
    "sentence": "the sentence's words before the span, the wh-word, its clause after it",
    "clause": "the span's clause alone, the wh-word in the span's place",
    "both": "each span asked both ways",
}
# How a cloze question is worded around its text, round-robin over the rows with
# ``BakeOptions.cloze_phrasings`` > 1 (issue 53: a patch fitted in one wording carries its facts
# in that wording; asked "Q: ...\nA:", it kept 0.2-0.3 of the F1 where its own wording kept 0.7-1).
# The first is ctxc's own (``ctxc.bake.selfstudy.QUESTION_FORMAT``); none is a wording the
# no-harm benchmark asks in (``benchmarks/thought/noharm.py``'s FORMS), which stay held out.
CLOZE_PHRASINGS: tuple[str, ...] = (
    "Question: {question}\nAnswer:",
    "{question} Answer:",
    "Query: {question}\nResponse:",
    "Tell me: {question}\nReply:",
)
# The same for a chat bake's user turn (the question alone is ctxc's own).
CLOZE_TURN_PHRASINGS: tuple[str, ...] = (
    "{question}",
    "Question: {question}",
    "Please tell me: {question}",
    "{question} Reply briefly.",
)

# How the model is asked to write a self-study question after the context (issue 35).
QUESTION_PROMPTS: dict[str, str] = {
    "plain": "' Question: <wh-word>' after the context",
    "facts": "a line asking for questions on the text's names, numbers and dates, then the wh-word",
}


def check_choice(param: str, value: object, choices: Iterable[str], what: str) -> str:
    """``value`` when it is one of ``choices``; else an :class:`OptionError` naming ``param``.

    Args:
        param: the library parameter that took ``value`` (``update``).
        value: the value given.
        choices: the names allowed (a dict of this module: its keys).
        what: what a value is, for the message (``update rule``).

    Returns:
        ``value``, checked.

    Raises:
        OptionError: ``update: unknown update rule 'x'; expected one of standard, ...``.
    """
    names = tuple(choices)
    if value not in names:
        raise OptionError(
            "{" + param + "}: unknown {} {!r}; expected one of {}", what, value, ", ".join(names)
        )
    return str(value)


def choices_help(choices: dict[str, str]) -> str:
    """``name (meaning); ...`` for an option's help text."""
    return "; ".join(f"{name}: {meaning}" for name, meaning in choices.items())
