"""The no-harm benchmark's general questions (``benchmarks/data/general/questions.json``,
issue 53): enough of them, each answerable, none asked by a SQuAD paragraph of the subset.

Quick: JSON only (tests import no benchmark).
"""

from __future__ import annotations

import json
from pathlib import Path

from testbed.squad_score import normalize

ROOT = Path(__file__).resolve().parents[2]
GENERAL = ROOT / "benchmarks" / "data" / "general" / "questions.json"
SUBSET = ROOT / "benchmarks" / "data" / "squad" / "subset.json"


def test_at_least_fifty_distinct_questions_each_with_an_accepted_answer() -> None:
    questions = json.loads(GENERAL.read_text())["questions"]
    asked = [q["q"] for q in questions]
    assert len(asked) >= 50, len(asked)
    assert len(set(asked)) == len(asked), "a question written twice"
    empty = [q["q"] for q in questions if not any(normalize(a) for a in q["a"])]
    assert not empty, f"no accepted answer that normalises to words: {empty}"


def test_no_general_question_is_one_of_the_subset_s() -> None:
    general = {normalize(q["q"]) for q in json.loads(GENERAL.read_text())["questions"]}
    squad = {
        normalize(q["question"])
        for p in json.loads(SUBSET.read_text())["paragraphs"]
        for q in p["questions"]
    }
    assert not general & squad, sorted(general & squad)
