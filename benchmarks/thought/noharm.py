"""No harm: what a baked paragraph's model does off its paragraph, beside what it keeps (issue 53).

A thought patch stands for its context, so the patched model fed a query alone should behave as
the original model fed the context first, on every query, not only on the context's questions.
For each SQuAD paragraph i of the vendored subset (``benchmarks/data/squad/subset.json``) and
each setting, the paragraph is baked (:func:`~ctxc.bake.driver.bake`, the setting's
``BakeOptions``), then four checks ask three models: ``full`` (the original fed paragraph i's
ids first), ``none`` (the original fed BOS) and ``baked`` (the patched model fed BOS):

- **reading**: paragraph i's own SQuAD questions in several question forms (:data:`FORMS`:
  ctxc's own, a plain ``Q:``/``A:`` pair, a chat-like ``User:``/``Assistant:`` turn), SQuAD's EM
  and F1, ``kept = (baked - none) / (full - none)``;
- **general**: short general-knowledge questions no paragraph answers
  (``benchmarks/data/general/questions.json``, written for this benchmark), each right when an
  accepted answer is in the answer line (normalised as SQuAD normalises); the patch's target is
  ``full``'s count;
- **other document**: paragraph j (the next paragraph of another article) and j's questions fed
  to the baked model of i, against the original fed the same (SQuAD F1);
- **off-topic text**: KL(full || baked) at every position of another article's opening words
  (its first :data:`TEXT_TOKENS` tokens) fed as the query, beside KL(full || none).

Answers are 16 greedy tokens, cut at a special token, their first line that is not blank
(``benchmarks.thought.squad.answers``). A query's ids follow the context's ids (no second BOS),
as ``ctxc bake`` splits a context and a query.

    python -m benchmarks.thought.noharm --paragraphs 10 --out benchmarks/results/noharm.json \\
        default linear_only=true
    python -m benchmarks.thought.noharm --render benchmarks/results/noharm.json \\
        > docs/results/noharm.md
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.thought.squad import DATA, answers, setting_options
from testbed.squad_score import normalize, score
from testbed.tables import commit, invocation

__all__ = ["FORMS", "GENERAL", "TEXT_TOKENS", "main", "right", "summary"]

ROOT = Path(__file__).resolve().parents[2]
GENERAL = ROOT / "benchmarks" / "data" / "general" / "questions.json"
# The question forms a user may ask in: ctxc's own (what self-study and cloze rows are fed), a
# plain pair, a chat-like turn without a template (the bundled model has none).
FORMS = {
    "ctxc": " Question: {q}\nAnswer:",
    "plain": "\nQ: {q}\nA:",
    "chat-like": "\nUser: {q}\nAssistant:",
}
TEXT_TOKENS = 48


def right(answer: str, accepted: list[str]) -> bool:
    """Whether an accepted answer's normalised words stand, in order and whole, in the
    normalised answer line."""
    got = f" {normalize(answer)} "
    return any(f" {normalize(a)} " in got for a in accepted if normalize(a))


def _ids(tok, text: str) -> list[int]:
    ids = list(tok(text, add_special_tokens=False).input_ids)
    assert ids, f"{text!r} tokenizes to nothing"
    return ids


def _queries(tok, questions: list[str], form: str) -> list[list[int]]:
    return [_ids(tok, FORMS[form].format(q=q.strip())) for q in questions]


def _f1(texts: list[str], golds: list[list[str]]) -> tuple[list[int], list[float]]:
    pairs = [score(t, g) for t, g in zip(texts, golds, strict=True)]
    return [e for e, _ in pairs], [round(f, 4) for _, f in pairs]


def _other(paragraphs: list[dict], i: int) -> dict:
    """The next paragraph of another article (wrapping): paragraph i's "other document"."""
    n = len(paragraphs)
    for step in range(1, n):
        j = paragraphs[(i + step) % n]
        if j["title"] != paragraphs[i]["title"]:
            return j
    raise SystemExit("the subset needs paragraphs of two articles")


def _refs(model, tok, para: dict, other: dict, general: list[dict]) -> dict:
    """The setting-independent answers of paragraph i: full and none in every check."""
    bos = list(tok("x").input_ids)[:1]
    ctx = list(tok(para["context"]).input_ids)
    golds = [q["answers"] for q in para["questions"]]
    questions = [q["question"] for q in para["questions"]]
    ref: dict = {"title": para["title"], "other": other["id"], "reading": {}, "general": {}}
    for form in FORMS:
        qs = _queries(tok, questions, form)
        for name, start in (("full", ctx), ("none", bos)):
            got = answers(model, tok, start, qs)["answers"]
            em, f1 = _f1(got, golds)
            ref["reading"][f"{form}/{name}"] = {"answers": got, "em": em, "f1": f1}
    gq = [g["q"] for g in general]
    for form in ("ctxc", "plain"):
        qs = _queries(tok, gq, form)
        for name, start in (("full", ctx), ("none", bos)):
            got = answers(model, tok, start, qs)["answers"]
            ok = [right(a, g["a"]) for a, g in zip(got, general, strict=True)]
            ref["general"][f"{form}/{name}"] = {"answers": got, "right": ok}
    octx = list(tok(other["context"]).input_ids)
    oq = _queries(tok, [q["question"] for q in other["questions"]], "ctxc")
    got = answers(model, tok, octx, oq)["answers"]
    em, f1 = _f1(got, [q["answers"] for q in other["questions"]])
    ref["other_document"] = {"answers": got, "em": em, "f1": f1}
    return ref


def _baked(model, tok, para: dict, other: dict, general: list[dict], setting: str) -> dict:
    """Bake paragraph i with ``setting`` and ask the patched model every check."""
    from ctxc.bake.data import FitData
    from ctxc.bake.driver import bake
    from ctxc.bake.evaluate import evaluate_many

    bos = list(tok("x").input_ids)[:1]
    ctx = list(tok(para["context"]).input_ids)
    clock, cpu = time.perf_counter(), time.process_time()
    result = bake(model, tok, context_ids=ctx, options=setting_options(setting))
    row: dict = {
        "bake_seconds": round(time.perf_counter() - clock, 2),
        "bake_cpu_seconds": round(time.process_time() - cpu, 2),
        "fit_kinds": result.report["fit_kinds"],
        "reading": {},
        "general": {},
        "commit": commit(),
        "threads": torch.get_num_threads(),
    }
    patch = result.patch
    # A general question the bake's own rows wrote verbatim (off-topic questions may): counted.
    fitted = [tok.decode(q) for q in result.data.queries]
    row["general_in_fit"] = sum(any(g["q"] in text for text in fitted) for g in general)
    golds = [q["answers"] for q in para["questions"]]
    for form in FORMS:
        qs = _queries(tok, [q["question"] for q in para["questions"]], form)
        got = answers(model, tok, bos, qs, patch=patch)["answers"]
        em, f1 = _f1(got, golds)
        row["reading"][form] = {"answers": got, "em": em, "f1": f1}
    for form in ("ctxc", "plain"):
        qs = _queries(tok, [g["q"] for g in general], form)
        got = answers(model, tok, bos, qs, patch=patch)["answers"]
        ok = [right(a, g["a"]) for a, g in zip(got, general, strict=True)]
        row["general"][form] = {"answers": got, "right": ok}
    octx = list(tok(other["context"]).input_ids)
    oq = _queries(tok, [q["question"] for q in other["questions"]], "ctxc")
    got = answers(model, tok, octx, oq, patch=patch)["answers"]
    em, f1 = _f1(got, [q["answers"] for q in other["questions"]])
    row["other_document"] = {"answers": got, "em": em, "f1": f1}
    text = list(tok(other["context"], add_special_tokens=False).input_ids)[:TEXT_TOKENS]
    data = FitData(ctx, bos, [text], ["text"])
    p, c = evaluate_many(model, [patch, None], data, 0)
    row["off_topic"] = {
        "baked_kl": p.kl,
        "none_kl": c.kl,
        "baked_top1": p.top1,
        "none_top1": c.top1,
    }
    return row


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summary(doc: dict, setting: str) -> dict:
    """Pooled figures of ``setting`` over its paragraphs (every question counts once)."""
    rows = doc["settings"][setting]["paragraphs"]
    refs = [doc["paragraphs"][p] for p in rows]
    got: dict = {"paragraphs": len(rows)}
    for form in FORMS:
        for fig in ("f1", "em"):
            full = [x for r in refs for x in r["reading"][f"{form}/full"][fig]]
            none = [x for r in refs for x in r["reading"][f"{form}/none"][fig]]
            baked = [x for b in rows.values() for x in b["reading"][form][fig]]
            f, n, b = (100 * _mean(v) for v in (full, none, baked))
            got[f"reading/{form}/{fig}"] = {
                "full": f,
                "none": n,
                "baked": b,
                "kept": (b - n) / (f - n) if f != n else None,
            }
    for form in ("ctxc", "plain"):
        full = sum(sum(r["general"][f"{form}/full"]["right"]) for r in refs)
        none = sum(sum(r["general"][f"{form}/none"]["right"]) for r in refs)
        baked = sum(sum(b["general"][form]["right"]) for b in rows.values())
        asked = sum(len(r["general"][f"{form}/full"]["right"]) for r in refs)
        got[f"general/{form}"] = {
            "asked": asked,
            "full": full,
            "none": none,
            "baked": baked,
            "ratio": baked / full if full else None,
        }
    orig = [x for r in refs for x in r["other_document"]["f1"]]
    baked_o = [x for b in rows.values() for x in b["other_document"]["f1"]]
    got["other_document"] = {
        "questions": len(orig),
        "original_f1": 100 * _mean(orig),
        "baked_f1": 100 * _mean(baked_o),
        "ratio": _mean(baked_o) / _mean(orig) if _mean(orig) else None,
    }
    got["off_topic"] = {
        "baked_kl": _mean([b["off_topic"]["baked_kl"] for b in rows.values()]),
        "none_kl": _mean([b["off_topic"]["none_kl"] for b in rows.values()]),
    }
    got["bake_cpu_seconds"] = _mean([b["bake_cpu_seconds"] for b in rows.values()])
    return got


def render(doc: dict, source: str) -> str:
    """The results page (Markdown)."""
    lines = [
        "# No harm: a baked paragraph off its paragraph (issue 53)",
        "",
        f"`{source}`, measured by `python -m benchmarks.thought.noharm` "
        f"(bundled Gemma 3 270M, float32, {doc.get('threads', '?')} threads); the checks and the "
        "question forms are in the module's docstring. Kept = (baked - none) / (full - none); "
        "general: questions right; other document: SQuAD F1 of the baked model of paragraph i "
        "reading paragraph j against the original reading j; off-topic: KL from the model fed "
        "the paragraph first, mean over positions of another article's opening.",
        "",
        "| setting | paragraphs | reading F1 kept: ctxc / plain / chat-like | EM kept (ctxc) | "
        "general right: baked / full / none (ratio to full) | other document F1: baked / "
        "original (ratio) | off-topic KL: baked / none | bake CPU s |",
        "|---|---:|---|---:|---|---|---|---:|",
    ]

    def k(x) -> str:
        return "-" if x is None else f"{x:.2f}"

    for setting, have in doc["settings"].items():
        if not have["paragraphs"]:
            continue
        s = summary(doc, setting)
        g, o, t = s["general/ctxc"], s["other_document"], s["off_topic"]
        kept = " / ".join(k(s[f"reading/{f}/f1"]["kept"]) for f in FORMS)
        lines.append(
            f"| `{setting}` | {s['paragraphs']} | {kept} | {k(s['reading/ctxc/em']['kept'])} | "
            f"{g['baked']} / {g['full']} / {g['none']} of {g['asked']} ({k(g['ratio'])}) | "
            f"{o['baked_f1']:.1f} / {o['original_f1']:.1f} ({k(o['ratio'])}) | "
            f"{t['baked_kl']:.3f} / {t['none_kl']:.3f} | {s['bake_cpu_seconds']:.0f} |"
        )
    lines += ["", "Reading F1 (full / none / baked) by form:", ""]
    for setting, have in doc["settings"].items():
        if not have["paragraphs"]:
            continue
        s = summary(doc, setting)
        parts = [
            f"{f} {s[f'reading/{f}/f1']['full']:.1f} / {s[f'reading/{f}/f1']['none']:.1f} / "
            f"{s[f'reading/{f}/f1']['baked']:.1f}"
            for f in FORMS
        ]
        lines.append(f"- `{setting}`: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def _write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    partial.replace(path)


def _run(args) -> None:
    from ctxc.cli.support import load
    from ctxc.store.traced import traced_blocks

    general = json.loads(GENERAL.read_text())["questions"]
    subset = json.loads(DATA.read_text())["paragraphs"]
    chosen = subset[args.skip : args.paragraphs]
    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {"paragraphs": {}, "settings": {}}
    for s in args.settings or ["default"]:
        opts = asdict(setting_options(s))
        have = doc["settings"].setdefault(s, {"options": opts, "paragraphs": {}, "commands": []})
        if have["options"] != opts:
            raise SystemExit(f"setting {s!r} in {out} had other options: use another --out")
        if invocation("benchmarks.thought.noharm") not in have["commands"]:
            have["commands"].append(invocation("benchmarks.thought.noharm"))
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load(None, "float32")
    traced_blocks(model)
    doc["threads"] = torch.get_num_threads()
    for n, para in enumerate(chosen, 1):
        pid = para["id"]
        other = _other(subset, subset.index(para))
        if pid not in doc["paragraphs"]:
            doc["paragraphs"][pid] = _refs(model, tok, para, other, general)
            _write(out, doc)
        for s in args.settings or ["default"]:
            if pid in doc["settings"][s]["paragraphs"]:
                continue
            doc["settings"][s]["paragraphs"][pid] = _baked(model, tok, para, other, general, s)
            _write(out, doc)
            f = summary(doc, s)
            print(
                f"[{n}/{len(chosen)}] {pid} {s}: kept F1 ctxc "
                f"{f['reading/ctxc/f1']['kept'] or 0:.2f}, general {f['general/ctxc']['baked']}"
                f"/{f['general/ctxc']['full']}, other F1 {f['other_document']['baked_f1']:.1f}"
                f"/{f['other_document']['original_f1']:.1f}, off-topic KL "
                f"{f['off_topic']['baked_kl']:.3f}/{f['off_topic']['none_kl']:.3f}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    """Measure (settings, ``--out``) or render (``--render JSON``: Markdown on stdout)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paragraphs", type=int, default=10, help="the subset's first N (of 40)")
    p.add_argument("--skip", type=int, default=0, help="leave the first N paragraphs out")
    p.add_argument("--out", default="benchmarks/results/noharm.json")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--render", metavar="JSON", help="print the Markdown page of a results file")
    p.add_argument("settings", nargs="*", help="'default' or name=value,... (BakeOptions)")
    args = p.parse_args(argv)
    if args.render:
        print(render(json.loads(Path(args.render).read_text()), args.render), end="")
    else:
        _run(args)


if __name__ == "__main__":
    main()
