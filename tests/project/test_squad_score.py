"""SQuAD scoring (``testbed/squad_score.py``) on known cases, and the vendored subset's shape.

Quick: builds no model, downloads nothing; the subset is read as JSON
(``benchmarks/data/squad/subset.json``, imported from nowhere: tests import no benchmark).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.squad_score import (
    contains,
    degenerate,
    exact_match,
    f1,
    normalize,
    score,
    tokens,
)

ROOT = Path(__file__).resolve().parents[2]
SUBSET = ROOT / "benchmarks" / "data" / "squad" / "subset.json"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("The Quick, brown fox!", "quick brown fox"),
        ("  An  apple a day\n", "apple day"),
        ("theory of a thing", "theory of thing"),  # articles as words only
        ("U.S. Army's 3rd", "us armys 3rd"),  # punctuation removed, not spaced
        ("The", ""),
    ],
)
def test_normalize_as_the_official_script(text: str, want: str) -> None:
    assert normalize(text) == want


def test_exact_match_and_f1() -> None:
    # SQuAD v1.1 dev's first question (Super Bowl 50): golds "Denver Broncos" x3.
    assert exact_match("Denver Broncos", "Denver Broncos") == 1
    assert exact_match("the Denver Broncos.", "Denver Broncos") == 1
    assert exact_match("Broncos", "Denver Broncos") == 0
    assert f1("the Broncos", "Denver Broncos") == pytest.approx(2 / 3)  # P 1, R 1/2
    assert f1("Denver Broncos won", "Denver Broncos") == pytest.approx(0.8)  # P 2/3, R 1
    assert f1("cat cat", "cat") == pytest.approx(2 / 3)  # a multiset overlap: P 1/2, R 1
    assert f1("Carolina Panthers", "Denver Broncos") == 0.0
    assert f1("", "Denver Broncos") == 0.0 and f1("", "") == 1.0
    assert tokens("") == []


def test_score_takes_the_best_gold() -> None:
    # SQuAD v2.0 dev "When were the Normans in Normandy?": golds differ by "in the".
    golds = ["10th and 11th centuries", "in the 10th and 11th centuries", "10th and 11th centuries"]
    assert score("in the 10th and 11th centuries", golds) == (1, 1.0)
    em, f = score("the 10th century", golds)
    assert em == 0 and f == pytest.approx(1 / 3)  # "10th" of 2 and of 4 tokens: P 1/2, R 1/4
    assert score("Rollo.", ["Rollo", "Rollo"]) == (1, 1.0)
    # Golds that normalise to nothing are dropped; none left: scored against "".
    assert score("", ["a", "The"]) == (1, 1.0)
    assert score("France", ["the", "France"]) == (1, 1.0)


def test_vendored_subset_follows_its_rule() -> None:
    doc = json.loads(SUBSET.read_text())
    paragraphs = doc["paragraphs"]
    assert len(paragraphs) == 40
    assert "CC BY-SA 4.0" in doc["license"] and "Rajpurkar" in doc["citation"]
    assert len({p["title"] for p in paragraphs[:35]}) == 35  # round 1: one per article
    assert len({p["id"] for p in paragraphs}) == 40
    ids = [q["id"] for p in paragraphs for q in p["questions"]]
    assert len(ids) == len(set(ids)) >= 160
    for p in paragraphs:
        assert 100 <= len(p["context"].split()) <= 200, p["id"]
        assert len(p["questions"]) >= 4, p["id"]
        assert all(q["question"].strip() and q["answers"] for q in p["questions"]), p["id"]
        # Every gold answer is a span of its paragraph (SQuAD's construction).
        assert all(a in p["context"] for q in p["questions"] for a in q["answers"]), p["id"]
    readme = (SUBSET.parent / "README.md").read_text()
    assert "CC BY-SA 4.0" in readme and "python -m benchmarks.thought.squad_build" in readme


def test_a_gold_answer_inside_a_sentence_is_found_by_whole_words() -> None:
    assert contains("The Norse leader was Rollo, a Viking.", ["Rollo"]) == 1
    assert contains("In the 10th century.", ["10th century", "the 10th"]) == 1
    assert contains("Rollover", ["Rollo"]) == 0  # not a run of whole words
    assert contains("anything", [""]) == 0  # an empty gold finds nothing


def test_degenerate_answers_are_loops_and_stutters_not_long_sentences() -> None:
    assert degenerate("To determine a level in in in in")
    loop = "the first true engine that was " * 3
    assert degenerate(loop)
    assert degenerate("| | | ; ; 12 ,, ok")
    eu = (
        "The European Parliament is the legislative body of the European Union, which is "
        "composed of the European Parliament and the European Council of the European Union."
    )
    assert not degenerate(eu)
    assert not degenerate("Rollo")
