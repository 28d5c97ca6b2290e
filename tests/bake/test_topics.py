"""The names and numbers a context mentions, for topic questions (issue 35): no model."""

from __future__ import annotations

from ctxc.bake.selfstudy import topics


def test_topics_are_names_and_numbers_in_order_of_first_mention_each_once() -> None:
    text = (
        "The Normans were descended from Norse raiders from Denmark, Iceland and Norway who, "
        "under their leader Rollo, swore fealty to King Charles III of West Francia in the "
        "10th century. Southern California's 10 counties. The Normans. It rained."
    )
    got = topics(text)
    assert got == [
        "Normans",
        "Norse",
        "Denmark",
        "Iceland and Norway",
        "Rollo",
        "King Charles III of West Francia",
        "10th century",
        "Southern California",
        "10 counties",
    ], got


def test_no_topics_in_text_without_names_or_numbers() -> None:
    assert topics("it was raining. The rain fell.") == []
