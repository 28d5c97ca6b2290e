"""Writing ``ctxc generate``'s results: ``generate.json``, a table, and a plot."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from ctxc.generate.steps import GenerateResult

__all__ = ["chat_answers", "plot_steps", "steps_table", "write_json"]


def write_json(
    result: GenerateResult, path: Path, tokens: list[str] | None = None, chat: dict | None = None
) -> Path:
    """``generate.json``: a list ``steps`` of per-step records, a summary and the settings.

    Args:
        tokens: the baseline's tokens as text (``baseline_text``).
        chat: a chat context's split and answers (:func:`chat_answers`), under ``chat``.
    """
    data = result.to_dict()
    if tokens is not None:
        data["baseline_text"] = tokens
    if chat is not None:
        data["chat"] = chat
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def chat_answers(split, result: GenerateResult, decode) -> dict:
    """A chat generation's answers: the full conversation's greedy tokens and the patched
    model's top-1 at each step (the protocol follows the full answer), as ids and text.

    Args:
        split: the :class:`~ctxc.core.chat.ChatSplit` the ids came from.
        decode: the tokenizer's ``decode``.
    """
    full = [s.baseline_token for s in result.steps]
    patched = [s.patched_token for s in result.steps]
    return {
        **split.to_dict(),
        "query_ids": split.query_ids,
        "full_answer_ids": full,
        "patched_answer_ids": patched,
        "full_answer": decode(full),
        "patched_answer": decode(patched),
        "answers_match": full == patched,
    }


def steps_table(result: GenerateResult, decode=None) -> Table:
    """A rich table: one row per step."""
    table = Table(
        title=f"per-token protocol ({result.update} rule, {result.dtype}, {result.apply})"
    )
    for col in ("step", "baseline", "patched", "match", "max |Δlogit|", "TV", "s"):
        table.add_column(col, justify="right")
    for s in result.steps:
        show = (lambda t: repr(decode([t]))) if decode else str
        table.add_row(
            str(s.step),
            show(s.baseline_token),
            show(s.patched_token),
            "yes" if s.match else "NO",
            f"{s.max_abs_logit_diff:.3g}",
            f"{s.total_variation:.3g}",
            f"{s.seconds:.2f}",
        )
    return table


def plot_steps(result: GenerateResult, path: Path) -> Path | None:
    """A PNG of max |logit diff| and total variation per step, mismatches marked.

    Returns:
        ``path``, or ``None`` when matplotlib (the ``plot`` extra) is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.step for s in result.steps]
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=120)
    ax.semilogy(
        steps,
        [max(s.max_abs_logit_diff, 1e-12) for s in result.steps],
        "o-",
        label="max |logit diff|",
    )
    ax.semilogy(
        steps, [max(s.total_variation, 1e-12) for s in result.steps], "s--", label="total variation"
    )
    bad = [s.step for s in result.steps if not s.match]
    if bad:
        ax.scatter(
            bad,
            [max(result.steps[i].max_abs_logit_diff, 1e-12) for i in bad],
            s=120,
            facecolors="none",
            edgecolors="red",
            label="top-1 mismatch",
        )
    ax.set_xlabel("generated token")
    ax.set_title(
        f"patched vs full context: {result.match_rate:.0%} top-1 match "
        f"({result.update}, {result.dtype})"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
