"""``ctxc.bake.route``: chunks cut at blank lines, the BM25 router's pick, its add, remove and
file round trip, and one-line refusals (no model built)."""

from __future__ import annotations

import json

import pytest

from ctxc.bake.route import ROUTER_FILE, Router, split_chunks
from ctxc.core.errors import CtxcError

_DOC = (
    "The Amazon rainforest covers seven million square kilometres.\n\n"
    "Deforestation of the rainforest began in the 1960s with cattle ranching.\n\n"
    "\n  \n"
    "Jacksonville is the largest city in Florida by area.\n\n"
    "The St. Johns River runs through Jacksonville to the Atlantic."
)


def test_split_chunks_joins_paragraphs_within_the_word_limit() -> None:
    paragraphs = [p.strip() for p in _DOC.split("\n\n") if p.strip()]
    assert split_chunks(_DOC, 1) == paragraphs  # each paragraph alone, none cut
    two = split_chunks(_DOC, 20)
    assert two == ["\n\n".join(paragraphs[:2]), "\n\n".join(paragraphs[2:])], two
    assert split_chunks(_DOC, 10_000) == ["\n\n".join(paragraphs)]
    for bad, message in (("  \n\n ", "no text"), (_DOC, "at least 1")):
        with pytest.raises(CtxcError, match=message):
            split_chunks(bad, 0 if bad == _DOC else 5)


def test_router_picks_the_chunk_holding_the_question_s_words() -> None:
    chunks = split_chunks(_DOC, 1)
    router = Router(("000", "001", "002", "003"), tuple(chunks), {"seed": 0})
    asked = {
        "How large is the Amazon rainforest?": "000",
        "When did deforestation begin?": "001",
        "What is the largest city in Florida?": "002",
        "Which river runs through Jacksonville?": "003",
    }
    got = {q: router.pick(q) for q in asked}
    assert got == asked, got
    scores = router.scores("Which river runs through Jacksonville?")
    assert max(scores) == scores[3] and scores[3] > scores[2] > 0, scores
    assert router.pick("zzz qqq") == "000"  # no word of the document: the first chunk


def test_router_add_remove_and_file_round_trip(tmp_path) -> None:
    chunks = split_chunks(_DOC, 1)
    router = Router((), (), {"seed": 3, "rank": 8}, 120)
    ids = router.next_ids(2)
    assert ids == ["000", "001"]
    router = router.added(ids, chunks[:2])
    later = router.added(router.next_ids(2), chunks[2:])
    assert later.ids == ("000", "001", "002", "003") and router.ids == ("000", "001")
    cut = later.removed("001")
    assert cut.ids == ("000", "002", "003") and cut.texts == (chunks[0], *chunks[2:])
    assert cut.next_ids(1) == ["004"]  # ids are never reused
    cut.save(tmp_path)
    back = Router.load(tmp_path)
    assert back == cut, (back, cut)
    with pytest.raises(CtxcError, match="no chunk '009'"):
        cut.removed("009")
    with pytest.raises(CtxcError, match="unique id"):
        Router(("000", "000"), ("a", "b"), {})


def test_a_router_records_chat_chunks(tmp_path) -> None:
    """A routed chat bake's router says so (``--add`` bakes chat chunks); one written before
    chat chunks existed (no ``chat``) is a plain one; anything but a boolean is refused."""
    chat = Router(("000",), ("w1 w2",), {"seed": 0}, emit=("lora",), chat=True)
    chat.save(tmp_path)
    assert json.loads((tmp_path / ROUTER_FILE).read_text())["chat"] is True
    assert Router.load(tmp_path) == chat and chat.added(["001"], ["w3"]).chat
    doc = json.loads(chat.text())
    del doc["chat"]
    (tmp_path / ROUTER_FILE).write_text(json.dumps(doc))
    assert Router.load(tmp_path).chat is False
    (tmp_path / ROUTER_FILE).write_text(json.dumps({**doc, "chat": "yes"}))
    with pytest.raises(CtxcError, match=r"is not a ctxc router \(chat 'yes'\)"):
        Router.load(tmp_path)


def test_a_folder_without_a_router_is_one_line(tmp_path) -> None:
    with pytest.raises(CtxcError, match="not a routed bake"):
        Router.load(tmp_path)
    (tmp_path / ROUTER_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(CtxcError, match="is not a ctxc router"):
        Router.load(tmp_path)
    with pytest.raises(CtxcError, match="holds no chunk"):
        Router((), (), {}).pick("anything")
