"""The adapter's model card (``README.md``): what it holds, on which base model, its figures, and
how plain PEFT loads it offline (PEFT's own card is a blank template).

A compile's adapter is exact for its query; a bake's is fitted and is not, and its card says so
with the bake's own figures (``report.json``'s ``figures``). Both name the base model as it is
(:class:`~ctxc.models.identity.BaseIdentity`: a GGUF file's name and SHA-256, a folder's recorded
name and revision, what an alias resolves to), not only ctxc's name for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ctxc.backends.peft.figures import PeftFigures
from ctxc.core.metrics import top1_word
from ctxc.models.identity import BaseIdentity

if TYPE_CHECKING:
    from ctxc.patch import Patch

__all__ = ["card_text", "load_line", "write_card"]

PAPER = "https://arxiv.org/abs/2511.17864"

# What each set of a bake's figures is (compiler/bake/folder.py:measure_figures).
_SETS = {
    "fit": "the first fit queries (fitted on)",
    "held_out_samples": "continuations sampled from the model reading the context (never fitted)",
    "held_out_queries": "the held-out queries given (never fitted)",
    "held_out_questions": "the held-out questions given (never fitted)",
    "off_topic": "text and questions written without the context (never fitted)",
}


def write_card(
    path: Path,
    patch: Patch,
    figures: PeftFigures,
    base: BaseIdentity,
    bake_report: dict | None = None,
) -> None:
    """Write ``path/README.md``: :func:`card_text`."""
    (path / "README.md").write_text(card_text(patch, figures, base, bake_report))


def load_line(base: BaseIdentity, folder: str) -> str:
    """The one line that loads the adapter in ``folder`` on its base model with plain PEFT:
    ``peft.AutoPeftModelForCausalLM.from_pretrained("lora", gguf_file="x.gguf")`` for a GGUF base
    (PEFT passes the keyword on to the base model's load), without it otherwise."""
    return f"peft.AutoPeftModelForCausalLM.from_pretrained({_q(folder)}{base.load_kwargs()})"


def card_text(
    patch: Patch, figures: PeftFigures, base: BaseIdentity, bake_report: dict | None = None
) -> str:
    """The card of an adapter: a bake's when the patch is baked (``meta.update`` ``bake-*``),
    else a compile's.

    Args:
        patch: the patch the adapter holds.
        figures: the adapter's :class:`~ctxc.backends.peft.figures.PeftFigures`.
        base: the base model's identity.
        bake_report: the bake's report (its ``options``, ``figures``), when the emit was given it.
    """
    baked = patch.meta.baked
    report = bake_report or {}
    body = _baked(patch, figures, base, report) if baked else _compiled(patch, figures, base)
    return _front(base, baked) + body + _loading(base, figures.dir, baked, "chat" in report)


def _front(base: BaseIdentity, baked: bool) -> str:
    lines = ["---", "library_name: peft"]
    if base.kind == "hub":
        lines.append(f"base_model: {base.load_path}")
    lines += ["tags:", "- ctxc", "- lora", "- thought-patch" if baked else "- context-compilation"]
    return "\n".join([*lines, "---", "", ""])


def _base_line(base: BaseIdentity) -> str:
    if base.kind == "unnamed":
        return f"- **Base model**: {base.describe()} (no path for `adapter_config.json`).\n"
    named = f"the file's folder `{base.load_path}`" if base.gguf_file else f"`{base.load_path}`"
    if base.kind == "hub" and base.revision:
        named += f" at revision `{base.revision}`"
    if base.gguf_file:
        named += f" (load it with `gguf_file={_q(base.gguf_file)}`)"
    where = (
        f"loads wherever the local Hugging Face cache holds it (`hf download {base.load_path}`)"
        if base.kind == "hub"
        else "a path on the machine that wrote it; elsewhere, load the same base yourself (below)"
    )
    return (
        f"- **Base model**: {base.describe()}; `ctxc.load_model({_q(base.name)})` loads it. "
        f"`adapter_config.json` names {named}: {where}.\n"
    )


def _compiled(patch: Patch, figures: PeftFigures, base: BaseIdentity) -> str:
    m = patch.meta
    bound = figures.full_context_bound
    return (
        "# A compiled context: LoRA adapter written by ctxc\n\n"
        f"This adapter holds one context, compiled by [ctxc]({PAPER}) {m.ctxc_version} into exact "
        "low-rank patches\nof the base model's MLP weights and norm scales: fed the query alone, "
        "the base model with it gives\nthe logits the base model gives on the context followed "
        "by the query.\n\n"
        + _base_line(base)
        + f"- **Context**: {len(m.context_ids)} tokens; **query**: {len(m.query_ids)} token(s) "
        "(the ids are in the patch,\n  `patch.safetensors`, and the compile's `report.json`). "
        "Feed the model exactly the query ids.\n"
        f"- **Update rule**: `{m.update}`; dtype `{m.dtype}`; first patched block "
        f"{m.start_layer}.\n"
        f"- **Holds**: {figures.holds()}.\n\n"
        "## Fidelity (the query alone against the base model fed context + query)\n\n"
        "| | max abs logit diff | top-1 |\n|---|---|---|\n"
        f"| as loaded (`W x + B (A x)`) | {figures.lora.max_abs_logit_diff:.3g} | "
        f"{top1_word(figures.lora.top1_match)} |\n"
        f"| after `merge_and_unload()` (the baked weights) | "
        f"{figures.merged.max_abs_logit_diff:.3g} | {top1_word(figures.merged.top1_match)} |\n\n"
        + (
            f"Both are held to {bound:.3g} (the compile's own figure and the runtime's slack). "
            if bound is not None
            else ""
        )
        + _sentence(figures.note)
        + "\n\n"
    )


def _trained(options: dict, update: str) -> str:
    """How the patch was made: fitted block by block, or a LoRA trained by context distillation
    (``ctxc.bake.distill``: KL to the base model reading the context, on the same queries)."""
    if (options.get("method") or update.removeprefix("bake-")) == "distill":
        return "trained by context distillation"
    return "fitted"


def _baked(patch: Patch, figures: PeftFigures, base: BaseIdentity, report: dict) -> str:
    m = patch.meta
    options = report.get("options") or {}
    how = [f"method `{options.get('method') or m.update.removeprefix('bake-')}`"]
    if options.get("linear_only"):
        how.append("linear-only")
    if options.get("rank") is not None:
        how.append(f"rank {options['rank']}")
    kinds = ", ".join(f"{n} `{k}`" for k, n in (report.get("fit_kinds") or {}).items())
    data = f" on {report['fit_queries']} fit queries ({kinds})" if report.get("fit_queries") else ""
    ask = (
        "the question as the user's turn, rendered by the model's chat template without the "
        "context turns (`report.json`'s `chat.opening_text` opens it)"
        if "chat" in report
        else "a query's text alone, tokenized with the tokenizer's BOS and no context; a question "
        "as `Question: <question>\\nAnswer:`, as the bake asked its own"
    )
    lora, merged, whole = figures.as_loaded_vs_patched, figures.merged_vs_patched, figures.lora
    agree = top1_word(whole.top1_match and figures.merged.top1_match, loud=False)
    parts = [
        "# A baked context: LoRA adapter written by ctxc\n\n",
        f"This adapter holds one context **baked** by [ctxc]({PAPER}) {m.ctxc_version} (`ctxc "
        f"bake`, {', '.join(how)}): a patch **{_trained(options, m.update)}**{data}, so that the "
        "base model fed a query "
        "alone behaves as it does after reading the context, on queries it was not fitted on "
        "too. It is **not exact**: it approximates the base model reading the context, and the "
        "figures below are measurements, not a bound.\n\n",
        _base_line(base),
        f"- **Context**: {len(m.context_ids)} tokens. **Ask it** as the bake was fitted: {ask}.\n",
        _route_line(report.get("route")),
        f"- **Holds**: {figures.holds()}; dtype `{m.dtype}`.\n\n",
        "## What the bake keeps (its `report.json` `figures`)\n\n",
        _figures_table(report.get("figures")),
        "## This adapter against the bake's patch\n\n",
        "What the adapter's check measures: the adapter loaded by PEFT on the base model, and "
        "ctxc's patched model (the bake's weights in torch), both fed the bake's first fit query "
        f"({len(m.query_ids)} tokens), max |logit diff|: how faithfully the adapter carries the "
        "patch, not how well the patch keeps the context (that is the table above).\n\n",
        "| | max abs logit diff | bound |\n|---|---|---|\n",
        f"| as loaded (`W x + B (A x)`) | {lora.max_abs_logit_diff:.3g} | {_bound(lora.bound)} |\n",
        f"| after `merge_and_unload()` (the baked weights) | {merged.max_abs_logit_diff:.3g} | "
        f"{_bound(merged.bound)} |\n\n",
        _sentence(figures.note),
        " On that query, against the base model fed the context first (not bounded: the patch "
        f"is fitted): max |logit diff| {whole.max_abs_logit_diff:.3g} as loaded, "
        f"{figures.merged.max_abs_logit_diff:.3g} merged, top-1 {agree}.\n\n",
    ]
    return "".join(parts)


def _bound(bound: float | None) -> str:
    return "reported, not bounded" if bound is None else f"{bound:.3g}"


def _route_line(route: dict | None) -> str:
    """A routed document's chunk (``compiler/bake/routed.py``): which, and how a question finds
    it."""
    if not route:
        return ""
    return (
        f"- **A chunk of a routed document**: chunk `{route.get('chunk')}` of "
        f"`{route.get('file')}` ({route.get('words')} words). A question reads one chunk: "
        "`ctxc route DOC --query TEXT` prints the folder of the chunk whose adapter answers it.\n"
    )


def _figures_table(found: dict | None) -> str:
    if not found:
        return (
            "No figures were measured with this adapter (`ctxc eval-bake` measures a bake folder "
            "on held-out queries).\n\n"
        )
    answers = any(pair["patched"].get("answers") is not None for pair in found.values())
    head = "| set | queries | KL | KL unpatched | top-1 | top-1 unpatched |"
    rule = "|---|---|---|---|---|---|"
    if answers:
        head += " answers as the full context's | unpatched |"
        rule += "---|---|"
    rows = []
    for name, pair in found.items():
        p, c = pair["patched"], pair["control"]
        row = (
            f"| `{name}`: {_SETS.get(name, name)} | {p['queries']} | {p['kl']:.3g} | "
            f"{c['kl']:.3g} | {p['top1']:.1%} | {c['top1']:.1%} |"
        )
        if answers:
            row += "".join(
                f" {x['answers']:.0%} |" if x.get("answers") is not None else " - |" for x in (p, c)
            )
        rows.append(row)
    return (
        "Each set: the base model with the patch, fed the query alone, against the base model fed "
        "the context and then the query; beside it, the base model without the patch. KL(full "
        "context || patched), nats, mean per position (lower is closer); top-1: the share of "
        "positions whose most likely token agrees.\n\n" + "\n".join([head, rule, *rows]) + "\n\n"
    )


def _loading(base: BaseIdentity, folder: str, baked: bool, chat: bool) -> str:
    path = f"PATH/TO/{folder}"
    if base.kind == "unnamed":
        return (
            "## How to load\n\nOn the model it was made on: "
            f'`peft.PeftModel.from_pretrained(model, "{path}")`.\n'
        )
    kwargs = base.load_kwargs()
    where = (
        _q(base.load_path)
        + (f", revision={_q(base.revision)}" if base.kind == "hub" and base.revision else "")
        + kwargs
    )
    if baked:
        ids = (
            'tokenizer.apply_chat_template([{"role": "user", "content": "...?"}], '
            'add_generation_prompt=True, return_tensors="pt").input_ids\n'
            if chat
            else 'tokenizer("Question: ...?\\nAnswer:", return_tensors="pt").input_ids\n'
        )
        use = f"ids = {ids}answer = model.generate(ids, max_new_tokens=24, do_sample=False)\n"
    else:
        use = "logits = model(torch.tensor([query_ids])).logits\n"
    gguf = (
        f"The base is a GGUF file: plain PEFT loads it with `gguf_file={_q(base.gguf_file)}`, "
        "which `AutoPeftModelForCausalLM` passes on to the base model's load; Transformers "
        "reads and de-quantises the file to float32 at every load (about 50 s for the bundled "
        "250 MB Gemma 3 270M on two cores).\n\n"
        if base.gguf_file
        else ""
    )
    return (
        "## How to load (plain PEFT, offline)\n\n"
        + gguf
        + "With `HF_HUB_OFFLINE=1` set, in one line:\n\n"
        f"    model = {load_line(base, path)}\n\n"
        "or on a base model loaded yourself (on another machine, the same base: "
        + (f"SHA-256 `{base.sha256}`" if base.sha256 else f"`{base.load_path}`")
        + "):\n\n"
        "```python\nimport peft, torch, transformers\n\n"
        f"base = transformers.AutoModelForCausalLM.from_pretrained({where})\n"
        f"tokenizer = transformers.AutoTokenizer.from_pretrained({where})\n"
        f'model = peft.PeftModel.from_pretrained(base, "{path}")\n'
        "# model.merge_and_unload(): the patched weights themselves, bit for bit\n"
        + use
        + "```\n\n"
        f"With ctxc: `base, tokenizer = ctxc.load_model({_q(base.name)})`, then "
        f'`peft.PeftModel.from_pretrained(base, "{path}")`.\n'
    )


def _q(text: str) -> str:
    """``text`` as a Python string literal in double quotes."""
    return json.dumps(text)


def _sentence(note: str) -> str:
    return note[:1].upper() + note[1:]
