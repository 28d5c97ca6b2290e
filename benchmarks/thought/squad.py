"""Reading comprehension of thought patches, judged on SQuAD's own answers (issue 35).

For each paragraph of the vendored subset (``benchmarks/data/squad/subset.json``, SQuAD v2.0
dev, CC BY-SA 4.0; ``benchmarks/data/squad/README.md``) and each setting, every answerable
question is asked three ways on the bundled Gemma 3 270M (float32, loaded as ``ctxc`` loads it
by default):

- ``full``: the original model fed the context's ids, then the query's ids (no second BOS);
- ``none``: the original model fed BOS + the query's ids (no context);
- ``baked``: :func:`~ctxc.bake.driver.bake` of the context with the setting, then the patched
  model fed BOS + the query's ids.

The context is the paragraph's text alone (no title), tokenized as ``ctxc bake`` tokenizes a
context file (with its BOS). The query is ctxc's own question form, as ``ctxc bake`` feeds a
held-out or self-study question: ``" Question: {q}\\nAnswer:"`` (:func:`as_question` through
:func:`text_queries`: a leading space, no special tokens). The split is checked token-exact for
every question: ``tokenizer(context + query)`` is the context's ids followed by the query's,
and ``tokenizer(query)`` is BOS followed by them. The bake never sees a SQuAD question: no query
file is given, its data are its own self-study questions and continuations (checked: no fit
query of kind ``file``; a self-study question that happens to equal a SQuAD question verbatim is
counted in ``questions_in_fit``).

Answers: 16 greedy tokens, every question of a paragraph in one left-padded batch continuing
one run of the context (or of BOS) (:func:`~ctxc.bake.selfstudy.continue_rows`), cut at a
special token, its first line that is not blank, stripped (white space and newlines before the
answer are skipped: the model sometimes starts its answer on the next line, ``"\\n1. Time\\n2.
Storage"``; the generated text is kept as ``*_raw``); the first question is also generated
alone (:func:`~ctxc.bake.evaluate.greedy`) and compared (``single_check``). Scored with SQuAD's
official normalised EM and token F1, the best over the gold answers
(``testbed/squad_score.py``); ``kept = (baked - none) / (full - none)`` over the means.

    python -m benchmarks.thought.squad --paragraphs 30 --out benchmarks/results/squad.json \\
        default rank=64
    python -m benchmarks.thought.squad --render benchmarks/results/squad.json \\
        > docs/results/squad.md

A setting is ``default`` (what ``ctxc bake`` runs with no options: ``BakeOptions()``, whose
rank budget is ``ctxc.core.options.DEFAULT_RANK``) or ``name=value`` comma lists over
:class:`BakeOptions` fields, parsed as ``benchmarks/thought/defaults.py`` parses them. The JSON
is written after every paragraph (one process per output file); a rerun skips the paragraphs a
setting already has, and the ``full`` and ``none`` answers (independent of the setting) are kept
once per paragraph. Per paragraph and setting it holds the bake's wall and CPU seconds, the
answers, their EM and F1, and ``paragraph_seconds`` (the bake and the baked answers, plus the
``full`` and ``none`` answers for the first setting to reach the paragraph).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.thought.squad_render import render, summary
from ctxc.core.vocabulary import FILE_KIND
from testbed.squad_score import score
from testbed.tables import commit, invocation

__all__ = [
    "DATA",
    "GEN_TOKENS",
    "answer_text",
    "answers",
    "chat_split",
    "main",
    "prompt_split",
    "setting_options",
]

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "data" / "squad" / "subset.json"
GEN_TOKENS = 16
FRAMING = "the paragraph's text alone, tokenized with its BOS"
QUERY = " Question: {question}\nAnswer:"  # what text_queries(as_question(q)) tokenizes
# --chat (a chat model): the paragraph as the system turn (ctxc bake --chat --system), each
# question a user turn; answers are sentences, so twice the tokens.
CHAT_FRAMING = "the paragraph as the system turn, through the model's chat template"
CHAT_QUERY = "the question as a user turn, with the generation prompt"
CHAT_GEN_TOKENS = 32
ANSWER = "cut at a special token, its first line that is not blank, stripped"


def setting_options(setting: str):
    """``default`` -> ``ctxc bake``'s own options; else ``benchmarks.thought.defaults.options``."""
    from benchmarks.thought.defaults import options
    from ctxc.core.options import BakeOptions

    return BakeOptions() if setting in ("", "default") else options(setting)


def prompt_split(tok, context: str, questions: list[str]) -> tuple[list[int], list[list[int]]]:
    """The context's ids (BOS first) and each question's query ids, checked token-exact.

    Raises:
        AssertionError: a question whose full prompt is not the context's ids followed by its
            query's, or whose reduced prompt is not BOS followed by them.
    """
    from ctxc.bake.data import special_prefix, text_queries
    from ctxc.bake.selfstudy import as_question

    prefix = special_prefix(tok)
    context_ids = list(tok(context).input_ids)
    assert context_ids[: len(prefix)] == prefix, (context_ids[:4], prefix)
    queries = text_queries(tok, [as_question(q) for q in questions])
    for q, ids in zip(questions, queries, strict=True):
        text = QUERY.format(question=q.strip())
        assert list(tok(context + text).input_ids) == context_ids + ids, f"full split: {q!r}"
        assert list(tok(text).input_ids) == prefix + ids, f"reduced split: {q!r}"
    return context_ids, queries


def chat_split(tok, context: str, questions: list[str]):
    """Chat framing: the paragraph as the system turn, each question a user turn. The context's
    ids, each question's turn ids (the template's, split exactly:
    :func:`~ctxc.bake.chat.chat_format`) and the opening the patched model is fed before a
    turn (the template's own for a lone user turn), and the context turns."""
    from ctxc.bake.chat import chat_format

    turns = [{"role": "system", "content": context}]
    chat = chat_format(tok, turns)
    assert chat.opening_exact, "the template renders a lone user turn otherwise"
    return chat.context_ids, [chat.turn(q) for q in questions], chat.opening, turns


def _raw(tok, ids: list[int]) -> str:
    """A generation's text, up to its first special token (an end of text)."""
    special = set(tok.all_special_ids)
    ids = ids[: next((i for i, t in enumerate(ids) if t in special), len(ids))]
    return tok.decode(ids, skip_special_tokens=True)


def answer_text(raw: str) -> str:
    """The answer in a generated text: its first line that is not blank, stripped."""
    return raw.lstrip().split("\n")[0].strip()


def answers(
    model, tok, start_ids: list[int], queries: list[list[int]], patch=None, gen: int = GEN_TOKENS
) -> dict:
    """Greedy answers of every query after ``start_ids`` (the context, or BOS), in one batch,
    with ``patch`` applied (None: the original model); question 0 also alone, compared.

    Returns:
        ``answers`` (texts), ``raw`` (the generated texts), ``seconds``, ``single_check``
        (question 0's answer generated alone equals its batched one).
    """
    from ctxc.bake.evaluate import greedy
    from ctxc.bake.selfstudy import continue_rows

    special = set(tok.all_special_ids)

    def done(ids: list[int]) -> bool:
        return any(t in special for t in ids) or "\n" in tok.decode(ids).lstrip()

    clock = time.perf_counter()
    applied = patch.applied(model) if patch is not None else contextlib.nullcontext()
    with torch.no_grad(), applied:
        rows = continue_rows(model, start_ids, queries, gen, until=done)
        alone = greedy(model, start_ids + queries[0], gen)
    raw = [_raw(tok, r) for r in rows]
    texts = [answer_text(r) for r in raw]
    return {
        "answers": texts,
        "raw": raw,
        "seconds": round(time.perf_counter() - clock, 2),
        "single_check": answer_text(_raw(tok, alone)) == texts[0],
    }


def _scored(texts: list[str], golds: list[list[str]]) -> tuple[list[int], list[float]]:
    pairs = [score(t, g) for t, g in zip(texts, golds, strict=True)]
    return [e for e, _ in pairs], [round(f, 4) for _, f in pairs]


def _framed(tok, para: dict, chat: bool) -> tuple:
    """``(context ids, query ids, what the patched model is fed first, context turns)``: the
    plain framing (BOS) or the chat one (the template's opening)."""
    from ctxc.bake.data import special_prefix

    questions = [q["question"] for q in para["questions"]]
    if chat:
        return chat_split(tok, para["context"], questions)
    context_ids, queries = prompt_split(tok, para["context"], questions)
    return context_ids, queries, context_ids[: len(special_prefix(tok))], None


def _paragraph_refs(model, tok, para: dict, chat: bool) -> dict:
    """The setting-independent part of a paragraph: its split and the full and none answers."""
    golds = [q["answers"] for q in para["questions"]]
    context_ids, queries, prefix, _ = _framed(tok, para, chat)
    entry: dict = {"title": para["title"], "context_tokens": len(context_ids), "questions": []}
    got = {}
    for name, start in (("full", context_ids), ("none", prefix)):
        got[name] = answers(model, tok, start, queries, gen=_gen(chat))
        entry[f"{name}_seconds"] = got[name]["seconds"]
        entry[f"{name}_single_check"] = got[name]["single_check"]
    for name in ("full", "none"):
        em, f1 = _scored(got[name]["answers"], golds)
        got[name].update(em=em, f1=f1)
    for i, q in enumerate(para["questions"]):
        entry["questions"].append({
            "id": q["id"], "question": q["question"], "answers": q["answers"],
            "query_tokens": len(queries[i]),
            **{f"{n}{k}": got[n][v][i] for n in ("full", "none")
               for k, v in (("", "answers"), ("_raw", "raw"), ("_em", "em"), ("_f1", "f1"))},
        })  # fmt: skip
    return entry


def _gen(chat: bool) -> int:
    return CHAT_GEN_TOKENS if chat else GEN_TOKENS


def _bake_paragraph(model, tok, para: dict, ref: dict, setting: str, chat: bool) -> dict:
    """Bake one paragraph with ``setting`` and answer its questions with the patch."""
    from ctxc.bake.driver import bake

    questions = [q["question"] for q in para["questions"]]
    context_ids, queries, prefix, turns = _framed(tok, para, chat)
    clock, cpu = time.perf_counter(), time.process_time()
    given = {"messages": turns} if chat else {"context_ids": context_ids}
    result = bake(model, tok, options=setting_options(setting), **given)
    seconds, cpu = time.perf_counter() - clock, time.process_time() - cpu
    assert FILE_KIND not in result.data.kinds, result.data.kinds  # no query was given to the fit
    fitted = [tok.decode(q) for q in result.data.queries]
    leaked = sum(any(q.strip() in text for text in fitted) for q in questions)
    got = answers(model, tok, prefix, queries, patch=result.patch, gen=_gen(chat))
    em, f1 = _scored(got["answers"], [q["answers"] for q in para["questions"]])
    same = sum(b == q["full"] for b, q in zip(got["answers"], ref["questions"], strict=True))
    return {
        "bake_seconds": round(seconds, 2), "bake_cpu_seconds": round(cpu, 2),
        "bake_timings": result.report["timings"], "bake_distill": result.report.get("distill"),
        "answer_seconds": got["seconds"], "single_check": got["single_check"],
        "fit_kinds": result.report["fit_kinds"], "fit_positions": result.report["fit_positions"],
        "questions_in_fit": leaked, "baked": got["answers"], "baked_raw": got["raw"],
        "baked_em": em, "baked_f1": f1,
        "same_as_full": same, "commit": commit(), "threads": torch.get_num_threads(),
    }  # fmt: skip


def _header(model: str | None, chat: bool) -> dict:
    return {
        "benchmark": "benchmarks.thought.squad",
        "model": f"{Path(model).name if model else 'gemma-3-270m (bundled)'}, float32",
        "framing": CHAT_FRAMING if chat else FRAMING,
        "query": CHAT_QUERY if chat else QUERY,
        "gen_tokens": _gen(chat),
        "answer": ANSWER,
        "subset_sha256": hashlib.sha256(DATA.read_bytes()).hexdigest(),
    }


def _load_out(path: Path, header: dict) -> dict:
    """The results so far (a new document when ``path`` is absent), refused when they were
    measured another way (another subset, framing, query or answer length)."""
    if not path.exists():
        return {**header, "paragraphs": {}, "settings": {}}
    doc = json.loads(path.read_text())
    differ = [k for k, v in header.items() if doc.get(k) != v]
    if differ:
        raise SystemExit(f"{path} was measured with other {differ}: use another --out")
    return doc


def _write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    partial.replace(path)


def _line(i: int, n: int, pid: str, setting: str, row: dict, ref: dict, so_far: dict) -> str:
    s = summary([(ref, row)])
    kept = "-" if s["kept_f1"] is None else f"{round(s['kept_f1'], 2) + 0.0:.2f}"
    total = "-" if so_far["kept_f1"] is None else f"{round(so_far['kept_f1'], 2) + 0.0:.2f}"
    return (
        f"[{i}/{n}] {pid} {setting}: {s['questions']} q, bake {row['bake_seconds']:.0f} s "
        f"(CPU {row['bake_cpu_seconds']:.0f} s), paragraph {row['paragraph_seconds']:.0f} s; "
        f"F1 full {s['full_f1']:.1f} none {s['none_f1']:.1f} baked {s['baked_f1']:.1f} "
        f"(kept {kept}); EM {s['full_em']:.0f}/{s['none_em']:.0f}/{s['baked_em']:.0f}; "
        f"same as full {row['same_as_full']}/{s['questions']}; so far {so_far['questions']} q "
        f"F1 {so_far['full_f1']:.1f}/{so_far['none_f1']:.1f}/{so_far['baked_f1']:.1f} "
        f"kept {total}"
    )


def _run(args) -> None:
    from ctxc.cli.support import load
    from ctxc.store.traced import traced_blocks

    commit()  # read once, now: the rows are stamped with the code this process imported
    settings = args.settings or ["default"]
    subset = json.loads(DATA.read_text())["paragraphs"][: args.paragraphs]
    subset = subset[args.skip :]  # another process takes the first ones (--merge joins them)
    out = Path(args.out)
    doc = _load_out(out, _header(args.model, args.chat))
    for s in settings:
        opts = asdict(setting_options(s))
        have = doc["settings"].setdefault(s, {"options": opts, "paragraphs": {}})
        if have["options"] != opts:
            raise SystemExit(f"setting {s!r} in {out} had other options: use another --out")
        command = invocation("benchmarks.thought.squad")
        if command not in have.setdefault("commands", []):
            have["commands"].append(command)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load(args.model, "float32")
    clock = time.perf_counter()
    traced_blocks(model)  # the export, once, outside every bake's seconds
    doc["threads"], doc["trace_seconds"] = (
        torch.get_num_threads(),
        round(time.perf_counter() - clock, 1),
    )
    for i, para in enumerate(subset, 1):
        pid = para["id"]
        todo = [s for s in settings if pid not in doc["settings"][s]["paragraphs"]]
        if not todo:
            continue
        clock = time.perf_counter()
        if pid not in doc["paragraphs"]:
            doc["paragraphs"][pid] = _paragraph_refs(model, tok, para, args.chat)
            _write(out, doc)
        ref = doc["paragraphs"][pid]
        for s in todo:
            row = _bake_paragraph(model, tok, para, ref, s, args.chat)
            row["paragraph_seconds"] = round(time.perf_counter() - clock, 1)
            clock = time.perf_counter()
            doc["settings"][s]["paragraphs"][pid] = row
            _write(out, doc)
            rows = [(doc["paragraphs"][p], r) for p, r in doc["settings"][s]["paragraphs"].items()]
            print(_line(i, len(subset), pid, s, row, ref, summary(rows)), flush=True)
            if row["questions_in_fit"]:
                print(f"  note: {row['questions_in_fit']} SQuAD question(s) written verbatim "
                      "by the bake's own self-study", flush=True)  # fmt: skip


def _merge(parts: list[Path], out: Path) -> None:
    """Join results files measured the same way (the same header) into ``out``: paragraphs and
    each setting's rows, in the subset's order."""
    docs = [json.loads(p.read_text()) for p in parts]
    order = [p["id"] for p in json.loads(DATA.read_text())["paragraphs"]]
    joined = _load_out(out, {k: v for k, v in docs[0].items() if k in _HEADER_KEYS})
    for doc in docs:
        if any(doc.get(k) != joined.get(k) for k in _HEADER_KEYS):
            raise SystemExit("the files were measured in different ways: not joined")
        joined["paragraphs"].update(doc["paragraphs"])
        for name, given in doc["settings"].items():
            have = joined["settings"].setdefault(name, {**given, "paragraphs": {}})
            if have["options"] != given["options"]:
                raise SystemExit(f"setting {name!r} has other options in another file")
            have["paragraphs"].update(given["paragraphs"])
            have["commands"] = list(dict.fromkeys(have["commands"] + given["commands"]))
    joined["paragraphs"] = {p: joined["paragraphs"][p] for p in order if p in joined["paragraphs"]}
    for have in joined["settings"].values():
        rows = have["paragraphs"]
        have["paragraphs"] = {p: rows[p] for p in order if p in rows}
    _write(out, joined)


_HEADER_KEYS = ("benchmark", "model", "framing", "query", "gen_tokens", "answer", "subset_sha256")


def main(argv: list[str] | None = None) -> None:
    """Measure (settings, ``--out``) or render (``--render JSON``: Markdown on stdout)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paragraphs", type=int, default=30, help="the subset's first N (of 40)")
    p.add_argument("--out", default="benchmarks/results/squad.json")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--render", metavar="JSON", help="print the Markdown page of a results file")
    p.add_argument("--model", default=None, help="alias, folder or .gguf (default: bundled)")
    p.add_argument("--skip", type=int, default=0, help="leave the first N paragraphs out")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join results files into --out")
    p.add_argument("--chat", action="store_true", help="chat framing (ctxc bake --chat --system)")
    p.add_argument("settings", nargs="*", help="'default' or name=value,... (BakeOptions)")
    args = p.parse_args(argv)
    if args.render:
        print(render(json.loads(Path(args.render).read_text()), args.render), end="")
    elif args.merge:
        _merge([Path(m) for m in args.merge], Path(args.out))
    else:
        _run(args)


if __name__ == "__main__":
    main()
