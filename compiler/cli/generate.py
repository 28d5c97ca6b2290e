"""``ctxc generate``: the paper's per-token protocol against greedy generation.

No torch import at module level (``ctxc --help`` stays fast).
"""

from __future__ import annotations

from pathlib import Path

import typer

from ctxc.cli.images import generate_inputs
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
    Update,
    placement_for,
)
from ctxc.cli.progress import VERBOSE, err, progress, say
from ctxc.cli.support import chat_input, check_chat, load, read_context
from ctxc.core.errors import CtxcError
from ctxc.store.output import output_folder

__all__ = ["generate_cmd"]


def generate_cmd(
    context: Path = typer.Option(None, "--context", help="UTF-8 text file with the context."),
    model: str | None = MODEL,
    max_new_tokens: int = typer.Option(20, "--max-new-tokens", help="Steps to generate."),
    update: Update = UPDATE,
    dtype: DType = DTYPE,
    out_dir: Path = typer.Option(Path("ctxc-generate"), "--out", help="Output folder."),
    device: str = DEVICE,
    device_map: str = DEVICE_MAP,
    max_memory: str = MAX_MEMORY,
    force: bool = FORCE,
    image: list[Path] = IMAGES,
    chat: bool = CHAT,
    system: Path = SYSTEM,
    document: Path = DOCUMENT,
    messages: Path = MESSAGES,
    query: str = typer.Option(None, "--query", help="With --chat: the next user message."),
    verbose: bool = VERBOSE,
) -> None:
    """The paper's protocol: recompile the patch at every token against greedy generation."""
    if chat and (context is not None or image):
        raise CtxcError("--chat takes --system, --document or --messages, not --context or --image")
    conversation = chat_input(chat, system, document, messages, query)  # read now, checked
    if query is not None and not chat:
        raise CtxcError("--query applies with --chat (else the context's text goes on)")
    if context is None and not image and conversation is None:
        raise CtxcError("missing option '--context'")
    text = read_context(context) if context is not None else ""
    if image:
        from ctxc.models.images import read_images

        read_images(image)  # every image read now, before the model loads
    from ctxc.core.options import GenerateOptions

    options = GenerateOptions(max_new_tokens, update)  # validated here, once
    where = placement_for(device, device_map, max_memory)
    if conversation is not None:
        check_chat(model, *conversation)  # the template, with the tokenizer alone: now
    with output_folder(out_dir, force, "generate") as tmp:
        from ctxc.generate.report import chat_answers, plot_steps, steps_table, write_json
        from ctxc.generate.steps import generate
        from ctxc.models.load import check_length

        net, tokenizer = load(model, dtype, where)
        ids, prefill, split = _inputs(net, tokenizer, model, text, image, conversation)
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
        answers = None if split is None else chat_answers(split, result, tokenizer.decode)
        write_json(result, tmp / "generate.json", tokens, answers)
        plotted = plot_steps(result, tmp / "generate.png")
    say(steps_table(result, tokenizer.decode))
    if answers is not None:
        say(f"answer (the full conversation, greedy): {answers['full_answer']!r}")
        say(f"answer (the patched model, per token):  {answers['patched_answer']!r}")
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


def _inputs(net, tokenizer, model: str | None, text: str, image, conversation) -> tuple:
    """(the ids generation starts from, the baseline's prefill inputs or None, the chat split
    or None): a chat conversation rendered by its template, an image context, or the text."""
    if conversation is not None:
        from ctxc.core.chat import split_chat

        split = split_chat(tokenizer, *conversation)
        return split.context_ids + split.query_ids, None, split
    if image:
        return (*generate_inputs(net, model, text, image), None)
    return list(tokenizer(text).input_ids), None, None
