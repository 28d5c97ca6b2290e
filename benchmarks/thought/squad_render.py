"""The SQuAD benchmark's figures and its Markdown page (``benchmarks/thought/squad.py``).

Torch-free: reads the results JSON only. :func:`summary` pools questions (every mean is over
all the questions of the paragraphs given, not a mean of paragraph means);
:func:`render` writes the page, stamped with the commit it was rendered at and the commits and
commands the figures were measured by:

    python -m benchmarks.thought.squad --render benchmarks/results/squad.json \\
        > docs/results/squad.md
"""

from __future__ import annotations

from testbed.squad_score import contains, degenerate
from testbed.tables import invocation, stamp, table

__all__ = ["EXAMPLES", "render", "summary"]

EXAMPLES = 5  # example answers shown per setting: the first question of the first paragraphs
_HEAD = ["questions", "EM full", "EM none", "EM baked", "F1 full", "F1 none", "F1 baked",
         "kept F1", "kept EM", "has gold full", "has gold none", "has gold baked", "kept has gold",
         "bake s", "bake CPU s", "same as full", "degenerate full/none/baked"]  # fmt: skip


def _kept(full: float, none: float, baked: float) -> float | None:
    """``(baked - none) / (full - none)``; None when the context adds nothing."""
    return None if full == none else (baked - none) / (full - none)


def summary(rows: list[tuple[dict, dict]]) -> dict:
    """Pooled figures of ``(paragraph reference, setting row)`` pairs (EM and F1 in percent).

    Returns:
        ``paragraphs``, ``questions``, ``{full,none,baked}_{em,f1}``, ``kept_f1``, ``kept_em``
        (None when full equals none), ``bake_seconds`` and ``bake_cpu_seconds`` (means per
        paragraph; the CPU time None when a row lacks it), ``same_as_full``.
    """
    out: dict = {"paragraphs": len(rows)}
    qs = [q for ref, _ in rows for q in ref["questions"]]
    out["questions"] = n = len(qs)
    for kind in ("em", "f1"):
        out[f"full_{kind}"] = 100 * sum(q[f"full_{kind}"] for q in qs) / max(n, 1)
        out[f"none_{kind}"] = 100 * sum(q[f"none_{kind}"] for q in qs) / max(n, 1)
        baked = [x for _, row in rows for x in row[f"baked_{kind}"]]
        out[f"baked_{kind}"] = 100 * sum(baked) / max(n, 1)
        out[f"kept_{kind}"] = _kept(out[f"full_{kind}"], out[f"none_{kind}"], out[f"baked_{kind}"])
    # a gold answer inside the answer: the figure for sentence answers (chat models)
    for kind in ("full", "none"):
        out[f"{kind}_has"] = 100 * sum(contains(q[kind], q["answers"]) for q in qs) / max(n, 1)
    baked = [contains(b, q["answers"]) for ref, row in rows
             for q, b in zip(ref["questions"], row["baked"], strict=True)]  # fmt: skip
    out["baked_has"] = 100 * sum(baked) / max(n, 1)
    out["kept_has"] = _kept(out["full_has"], out["none_has"], out["baked_has"])
    out["bake_seconds"] = sum(row["bake_seconds"] for _, row in rows) / max(len(rows), 1)
    cpu = [row.get("bake_cpu_seconds") for _, row in rows]
    out["bake_cpu_seconds"] = None if None in cpu or not cpu else sum(cpu) / len(cpu)
    out["same_as_full"] = sum(row["same_as_full"] for _, row in rows)
    # answers that are garbage, not sentences (testbed.squad_score.degenerate)
    out["degenerate"] = {
        "full": sum(degenerate(q["full"]) for q in qs),
        "none": sum(degenerate(q["none"]) for q in qs),
        "baked": sum(degenerate(b) for _, row in rows for b in row["baked"]),
    }
    return out


def _cells(s: dict) -> list[object]:
    def kept(x: float | None) -> str:
        return "-" if x is None else f"{round(x, 2) + 0.0:.2f}"  # no "-0.00"

    return [
        s["questions"], *(f"{s[k]:.1f}" for k in ("full_em", "none_em", "baked_em")),
        *(f"{s[k]:.1f}" for k in ("full_f1", "none_f1", "baked_f1")),
        kept(s["kept_f1"]), kept(s["kept_em"]),
        *(f"{s[k]:.1f}" for k in ("full_has", "none_has", "baked_has")), kept(s["kept_has"]),
        f"{s['bake_seconds']:.1f}",
        "-" if s["bake_cpu_seconds"] is None else f"{s['bake_cpu_seconds']:.1f}",
        f"{s['same_as_full']}/{s['questions']}",
        "/".join(str(s["degenerate"][k]) for k in ("full", "none", "baked")),
    ]  # fmt: skip


def _rows(doc: dict, setting: str) -> list[tuple[str, dict, dict]]:
    """(paragraph id, reference, row) of a setting, in the subset's order (the reference's)."""
    done = doc["settings"][setting]["paragraphs"]
    return [(p, ref, done[p]) for p, ref in doc["paragraphs"].items() if p in done]


def _examples(rows: list[tuple[str, dict, dict]]) -> str:
    found = []
    for _, ref, row in rows[:EXAMPLES]:
        q = ref["questions"][0]
        found.append([q["question"], q["answers"][0], q["full"], q["none"], row["baked"][0]])
    return table(["question", "gold", "full", "none", "baked"], found)


def _setting(doc: dict, setting: str) -> str:
    rows = _rows(doc, setting)
    given = doc["settings"][setting]
    commits = sorted({r.get("commit", "?") for _, _, r in rows})
    threads = sorted({r.get("threads", doc.get("threads", "?")) for _, _, r in rows}, key=str)
    lines = [f"## `{setting}`", ""]
    count = f"{len(rows)} paragraph{'s' if len(rows) != 1 else ''}"
    lines += [f"{count}, torch threads {', '.join(map(str, threads))}.", ""]
    lines += [f"Measured at commit {', '.join(f'`{c}`' for c in commits)} by:", ""]
    lines += [f"    {c}" for c in dict.fromkeys(given.get("commands", []))] + [""]
    per = [[p, *_cells(summary([(ref, row)]))] for p, ref, row in rows]
    lines += [table(["paragraph", *_HEAD], per), "Example answers (each paragraph's first "
              "question, its first gold answer):", "", _examples(rows)]  # fmt: skip
    return "\n".join(lines)


def render(doc: dict, source: str) -> str:
    """The Markdown page of a results document (``source``: its path, for the command)."""
    command = invocation("benchmarks.thought.squad", ["--render", source])
    head = [
        "# Thought patches on SQuAD: reading comprehension with the context baked",
        "",
        stamp(command, action="Rendered"),
        f"Model: {doc['model']}. Context: "
        f"{doc['framing']}. Query: `{doc['query']!r}` (BOS, or the chat template's opening, "
        "first when fed alone). Answers: "
        f"{doc['gen_tokens']} greedy tokens, {doc['answer']}, scored with SQuAD's "
        "normalised EM and token F1 (best over the gold answers), in percent over all "
        "questions. full: the original model fed context + query; none: fed the query alone; "
        "baked: the patched model fed the query alone. kept = (baked - none) / (full - none). "
        "bake s: the bake call's wall time per paragraph; bake CPU s: the process's CPU time "
        "in it (all threads: at 1 thread, the wall time the bake would take alone on its core). "
        "has gold: answers holding a gold answer as a run of whole words (normalised; the "
        "figure for the sentences a chat model answers in, which F1 counts against). "
        "same as full: baked answers equal "
        "to the full-context answer; degenerate: answers that are not sentences (a word "
        "three times running, a run of four words three times over, or under half the words "
        "holding a letter). Data: `benchmarks/data/squad/subset.json` (SQuAD v2.0 "
        "dev, CC BY-SA 4.0).",
        "",
    ]
    settings = list(doc["settings"])
    pooled = {s: summary([(r, w) for _, r, w in _rows(doc, s)]) for s in settings}
    overall = [[f"`{s}`", pooled[s]["paragraphs"], *_cells(pooled[s])] for s in settings]
    body = [table(["setting", "paragraphs", *_HEAD], overall)]
    body += [_setting(doc, s) for s in settings]
    return "\n".join(head) + "\n" + "\n".join(body)
