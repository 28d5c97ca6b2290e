"""Self-study fit data: questions about the context that the model writes itself, answered
with the context in view (Cartridges, arXiv 2506.06266, section 4; issue 25).

Continuation samples teach the patch what follows the context; a patch is asked questions.
Here the model fed ``context + "\\n\\n" + seed prompt + "\\n"`` samples a question (temperature
1, cut at its first ``?`` or newline), then the model fed ``context + " " + question`` answers
it greedily; the fit query is the question's ids (as :func:`~ctxc.bake.data.text_queries` gives
them, the way a held-out question is fed) followed by the answer's. The context runs once:
every row continues a copy of its KV cache in one batch, rows of different lengths left-padded
with an attention mask and their own position ids (:func:`continue_rows`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from collections.abc import Callable

import torch

from ctxc.bake.data import sample_tokens
from ctxc.models.kv_cache import cache_of, with_cache
from ctxc.runs.shortlist_head import shortlist_head

__all__ = [
    "NOT_TOPICS",
    "QUESTION_FORMAT",
    "QUESTION_PROMPTS",
    "SEED_PROMPTS",
    "TOPIC_QUESTION",
    "answer_end",
    "as_question",
    "context_run",
    "continue_rows",
    "self_study",
    "topics",
]

# Seed prompts, cycled over the questions (Cartridges seeds structuring, summarisation,
# question and use-case prompts for chat models; the bundled 270M model is pretrained, with no
# chat template: it writes questions when the text itself starts one, a wh-word varying them).
SEED_PROMPTS = ("What", "Who", "When", "How", "Why", "Which", "Where", "How many")

# How a question is put to the model after the context (held-out questions the same way): a
# pretrained model answers after "Answer:".
QUESTION_FORMAT = "Question: {question}\nAnswer:"

# What comes between the context and the wh-word when the model writes a question
# (``BakeOptions.question_prompt``). ``plain`` asks nothing: the 270M model then writes about
# the text's main subject ("Who were the Normans?"). ``facts`` asks for questions answered by a
# name, number, date or short phrase from the text, the questions readers ask (SQuAD's), and
# the model's questions then reach past the subject ("Who was the first person to claim French
# territory?", at temperature 0.6).
QUESTION_PROMPTS = {
    "plain": " Question: {seed}",
    "facts": "\n\nQuestions about facts in the text above, each answered by a name, a number, a "
    "date or a short phrase from it:\nQuestion: {seed}",
}

# A topic question: what the text says about one name or number it mentions (``topics``).
TOPIC_QUESTION = "What does the text say about {topic}?"

# Capitalised runs (joined by of/de/and/the: "King Charles III of West Francia") and numbers
# with the word after them ("10th and 11th centuries" gives "10th", "10 counties").
_TOPIC = re.compile(
    r"\b[A-Z][\w'’-]*(?:\s+(?:(?:of|de|and|the)\s+)?[A-Z][\w'’-]*)*"
    r"|\b\d[\d,.]*(?:st|nd|rd|th|s)?(?:\s+[a-z]+)?"
)
# Capitalised words that are sentence furniture, not topics, at the start of a run.
# fmt: off
NOT_TOPICS = frozenset((
    "The", "A", "An", "In", "On", "At", "It", "Its", "This", "That", "These", "Those", "They",
    "He", "She", "We", "I", "You", "His", "Her", "Their", "Our", "For", "From", "By", "With",
    "As", "But", "And", "Or", "If", "When", "While", "After", "Before", "During", "Since",
    "Although", "Because", "Some", "Many", "Most", "Other", "Such", "There", "Here", "What",
    "Who", "Which", "Where", "How", "Why", "Also", "However",
))
# fmt: on


def as_question(question: str) -> str:
    """A question's text in :data:`QUESTION_FORMAT` (the query text fed after the context)."""
    return QUESTION_FORMAT.format(question=question.strip())


def continue_rows(
    model: torch.nn.Module,
    context_ids: list[int],
    rows: list[list[int]],
    steps: int,
    generator: torch.Generator | None = None,
    start=None,
    until: Callable[[list[int]], bool] | None = None,
    temperature: float = 1.0,
) -> list[list[int]]:
    """``steps`` tokens after ``context + row`` for every row, in one batch (greedy, or sampled
    at temperature 1 when ``generator`` is given), or fewer once ``until`` holds for every row.

    The context runs once; its cache is repeated per row. Rows are left-padded: the padding is
    masked out and each row's position ids continue the context as if it were alone, so every
    row computes what it would alone, up to rounding. A sliding window counts cache slots,
    padding included: past the window, rows of each length are batched apart, unpadded.

    Args:
        model: a causal LM.
        context_ids: the shared context.
        rows: each row's ids after the context (at least one each).
        steps: tokens to generate.
        generator: sampling RNG; None: greedy.
        temperature: the sampling temperature (the logits divided by it; 1: as they are).
        start: the model's output on the context with its cache (``use_cache=True``), when
            already computed (left as it was: the cache is copied).
        until: a row's generated ids so far -> whether it is finished; decoding stops when
            every row is (a finished row's later tokens are cut the same, so every row is the
            full draw's up to where ``until`` first held). Past a sliding window (batches by
            length) every batch draws all ``steps``.

    Returns:
        the generated ids, [len(rows)][steps or fewer], every row as long.
    """
    c, width = len(context_ids), max(len(r) for r in rows)
    window = _sliding_window(model)
    if window is not None and c + width + steps > window and len({len(r) for r in rows}) > 1:
        # A sliding window counts cache slots, padding included: pad only within the window;
        # past it, each length is its own (unpadded) batch.
        start = start if start is not None else context_run(model, context_ids)
        out: list = [None] * len(rows)
        for n in sorted({len(r) for r in rows}):
            idx = [i for i, r in enumerate(rows) if len(r) == n]
            # Each length draws all its steps: a batch stopped early would leave the generator
            # where the next batch's draws would differ from an unstopped run's.
            part = [rows[i] for i in idx]
            got = continue_rows(
                model, context_ids, part, steps, generator, start, temperature=temperature
            )
            for i, g in zip(idx, got, strict=True):
                out[i] = g
        return out
    return _padded(model, context_ids, rows, steps, generator, start, until, temperature)


def _sliding_window(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def _padded(
    model, context_ids, rows, steps, generator, start, until, temperature=1.0
) -> list[list[int]]:
    """:func:`continue_rows` in one left-padded batch."""
    device = next(model.parameters()).device
    c, b = len(context_ids), len(rows)
    width = max(len(r) for r in rows)
    # Greedy answers read the head in bfloat16, its top exact: the same picks (shortlist_head);
    # sampled questions read it whole (a bfloat16 tail would move 3% of the draws).
    head = shortlist_head(model) if generator is None else contextlib.nullcontext()
    with torch.no_grad(), head:
        first = start if start is not None else context_run(model, context_ids)
        cache = copy.deepcopy(cache_of(first))
        cache.batch_repeat_interleave(b)
        ids = torch.zeros(b, width, dtype=torch.long)
        mask = torch.ones(b, c + width, dtype=torch.long)
        pos = torch.zeros(b, width, dtype=torch.long)
        for i, r in enumerate(rows):
            pad = width - len(r)
            ids[i, pad:] = torch.tensor(r)
            mask[i, c : c + pad] = 0
            pos[i, pad:] = torch.arange(c, c + len(r))
        last = pos[:, -1]  # [b]
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos.to(device),
            **with_cache(model, cache),
            use_cache=True,
            logits_to_keep=1,
        )
        got = []
        for step in range(steps):
            logits = out.logits[:, -1].float().cpu()  # [b, vocab]
            if temperature != 1.0:
                logits = logits / temperature
            tok = logits.argmax(-1) if generator is None else sample_tokens(logits, generator)
            got.append(tok)
            if step + 1 == steps or (until is not None and _all_done(got, until)):
                break
            last = last + 1
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], 1)
            out = model(
                input_ids=tok[:, None].to(device),
                attention_mask=mask.to(device),
                position_ids=last[:, None].to(device),
                **with_cache(model, cache_of(out)),
                use_cache=True,
                logits_to_keep=1,
            )
    return torch.stack(got, 1).tolist()


def _all_done(got: list[torch.Tensor], until: Callable[[list[int]], bool]) -> bool:
    """Whether ``until`` holds for every row of the tokens drawn so far ([b] per step)."""
    rows = torch.stack(got, 1).tolist()  # [b, steps so far]
    return all(until(r) for r in rows)


def context_run(model: torch.nn.Module, context_ids: list[int]):
    """The model's output on the context alone, with its KV cache (last logits only)."""
    device = next(model.parameters()).device
    with torch.no_grad():
        ids = torch.tensor([context_ids], device=device)
        return model(input_ids=ids, use_cache=True, logits_to_keep=1)


def _question(tokenizer, seed: str, ids: list[int]) -> str:
    """The seed word and the sampled text up to its first ``?`` (kept) or newline, stripped;
    empty when there is no ``?`` (not a question)."""
    text = seed + tokenizer.decode(ids, skip_special_tokens=True)
    end, line = text.find("?"), text.find("\n")
    if end < 0 or 0 <= line < end:
        return ""
    return text[: end + 1].strip()


def _ended(tokenizer, ids: list[int]) -> bool:
    """Whether a sampled question's text holds its end (``?`` or a newline): :func:`_question`
    reads no further."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return "?" in text or "\n" in text


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def self_study(
    model: torch.nn.Module,
    tokenizer,
    context_ids: list[int],
    count: int,
    question_tokens: int = 24,
    answer_tokens: int = 24,
    seed: int = 0,
    start=None,
    prompt: str = "plain",
    temperature: float = 1.0,
    topic_count: int = 0,
) -> tuple[list[list[int]], list[str]]:
    """``count`` self-study queries: a sampled question and the model's greedy answer with the
    context in view.

    Args:
        model: the unpatched causal LM.
        tokenizer: its tokenizer (the seed prompts, the questions' text).
        context_ids: the context ids.
        count: how many questions (seed prompts cycled).
        question_tokens: tokens sampled per question before the cut.
        answer_tokens: greedy answer tokens.
        seed: the sampling seed.
        start: :func:`context_run` of the context, when already computed.
        prompt: a :data:`QUESTION_PROMPTS` key: what precedes the wh-word.
        temperature: the questions' sampling temperature.
        topic_count: :data:`TOPIC_QUESTION` questions added for the first ``topic_count`` of
            :func:`topics` of the context's text (after the sampled ones).

    Returns:
        (the queries' ids, each question followed by its answer; the questions' texts). A
        sampled question that is empty after the cut is drawn again once, then dropped.
    """
    gen = torch.Generator().manual_seed(seed)
    start = start if start is not None else context_run(model, context_ids)
    questions: list[str] = []
    for _ in range(2):  # a second draw for the ones that are not questions
        need = count - len(questions)
        if need <= 0:
            break
        seeds = [SEED_PROMPTS[(len(questions) + i) % len(SEED_PROMPTS)] for i in range(need)]
        rows = [_ids(tokenizer, QUESTION_PROMPTS[prompt].format(seed=s)) for s in seeds]
        ended = functools.partial(_ended, tokenizer)
        drawn = continue_rows(
            model, context_ids, rows, question_tokens, gen, start, ended, temperature
        )
        found = [_question(tokenizer, s, d) for s, d in zip(seeds, drawn, strict=True)]
        questions += [q for q in found if q][:need]
    if topic_count:
        text = tokenizer.decode(context_ids, skip_special_tokens=True)
        questions += [TOPIC_QUESTION.format(topic=t) for t in topics(text)[:topic_count]]
    if not questions:
        return [], []
    asked = [_ids(tokenizer, " " + as_question(q)) for q in questions]
    ends = functools.partial(answer_end, tokenizer)
    answers = continue_rows(
        model, context_ids, asked, answer_tokens, start=start, until=lambda a: ends(a) < len(a)
    )
    # An answer ends at its first line break or special token (kept: the patch learns to stop
    # there). What the model writes past it ("\nAnswer: ...", "<eos>The Normans...") is not
    # an answer to the question and would be fitted as if it were.
    return [q + a[: ends(a)] for q, a in zip(asked, answers, strict=True)], questions


def answer_end(tokenizer, ids: list[int]) -> int:
    """The length of an answer cut after its first token that holds a line break or is a
    special token (the whole answer when there is none)."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    for i, t in enumerate(ids):
        if t in special or "\n" in tokenizer.decode([t]):
            return i + 1
    return len(ids)


def topics(text: str) -> list[str]:
    """The names and numbers ``text`` mentions, in order of first mention, each once.

    A capitalised run loses a leading word of :data:`NOT_TOPICS` ("The Normans" -> "Normans");
    a run of such words alone is dropped.
    """
    seen: dict[str, None] = {}
    for match in _TOPIC.finditer(text):
        words = re.sub(r"['’]s$", "", match.group(0).strip(" ,.")).split()
        while words and words[0] in NOT_TOPICS:
            words = words[1:]
        if words and words[-1] in ("of", "de", "and", "the"):
            words = words[:-1]
        topic = " ".join(words)
        if topic and topic.lower() not in {k.lower() for k in seen}:
            seen[topic] = None
    return list(seen)
