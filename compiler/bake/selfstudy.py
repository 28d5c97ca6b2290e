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

import copy
import functools
from collections.abc import Callable

import torch

from ctxc.bake.data import sample_tokens

__all__ = [
    "QUESTION_FORMAT",
    "SEED_PROMPTS",
    "as_question",
    "context_run",
    "continue_rows",
    "self_study",
]

# Seed prompts, cycled over the questions (Cartridges seeds structuring, summarisation,
# question and use-case prompts for chat models; the bundled 270M model is pretrained, with no
# chat template: it writes questions when the text itself starts one, a wh-word varying them).
SEED_PROMPTS = ("What", "Who", "When", "How", "Why", "Which", "Where", "How many")

# How a question is put to the model after the context (held-out questions the same way): a
# pretrained model answers after "Answer:".
QUESTION_FORMAT = "Question: {question}\nAnswer:"


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
            got = continue_rows(model, context_ids, [rows[i] for i in idx], steps, generator, start)
            for i, g in zip(idx, got, strict=True):
                out[i] = g
        return out
    return _padded(model, context_ids, rows, steps, generator, start, until)


def _sliding_window(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    window = getattr(config, "sliding_window", None)
    return int(window) if window else None


def _padded(model, context_ids, rows, steps, generator, start, until) -> list[list[int]]:
    """:func:`continue_rows` in one left-padded batch."""
    device = next(model.parameters()).device
    c, b = len(context_ids), len(rows)
    width = max(len(r) for r in rows)
    with torch.no_grad():
        first = start if start is not None else context_run(model, context_ids)
        cache = copy.deepcopy(first.past_key_values)
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
            input_ids=ids.to(device), attention_mask=mask.to(device),
            position_ids=pos.to(device), past_key_values=cache, use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        got = []
        for step in range(steps):
            logits = out.logits[:, -1].float().cpu()  # [b, vocab]
            tok = logits.argmax(-1) if generator is None else sample_tokens(logits, generator)
            got.append(tok)
            if step + 1 == steps or (until is not None and _all_done(got, until)):
                break
            last = last + 1
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], 1)
            out = model(
                input_ids=tok[:, None].to(device), attention_mask=mask.to(device),
                position_ids=last[:, None].to(device), past_key_values=out.past_key_values,
                use_cache=True, logits_to_keep=1,
            )  # fmt: skip
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
        rows = [_ids(tokenizer, " " + as_question(s).split("\n")[0]) for s in seeds]
        ended = functools.partial(_ended, tokenizer)
        drawn = continue_rows(model, context_ids, rows, question_tokens, gen, start, ended)
        found = [_question(tokenizer, s, d) for s, d in zip(seeds, drawn, strict=True)]
        questions += [q for q in found if q][:need]
    if not questions:
        return [], []
    asked = [_ids(tokenizer, " " + as_question(q)) for q in questions]
    answers = continue_rows(model, context_ids, asked, answer_tokens, start=start)
    return [q + a for q, a in zip(asked, answers, strict=True)], questions
