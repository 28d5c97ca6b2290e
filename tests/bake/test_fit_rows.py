"""Which positions of the fit data are fitted (issue 35): no model."""

from __future__ import annotations

from ctxc.bake.data import FitData
from ctxc.bake.driver import query_rows


def test_answers_only_fits_from_the_position_before_each_answer() -> None:
    """A self-study query (question of 3 ids, answer of 2) fits its last question position and
    its answer's; a sample (answer_from 0) fits every position; the BOS never."""
    data = FitData([1, 5, 6], [1], [[7, 8, 9, 10, 11], [12, 13]], ["self-study", "sample"],
                   answer_from=[3, 0])  # fmt: skip
    rows = query_rows(data, answers=True).tolist()
    assert rows == [False, False, False, True, True, True, False, True, True], rows
    every = query_rows(data).tolist()
    assert every == [False, True, True, True, True, True, False, True, True], every
    assert data.part(1).answer_from == [0]
