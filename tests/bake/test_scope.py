"""``ctxc.bake.scope``: a query's coverage by a context's words, the gate it drives in the
router and ``ctxc route``, its file round trip and one-line refusals (no model built)."""

from __future__ import annotations

import json

import pytest

from ctxc.bake.route import Router
from ctxc.bake.scope import COMMON_CB, SCOPE_FILE, UNLISTED_CB, Scope, rarity, terms
from ctxc.core.errors import CtxcError
from tests.fixtures.helpers import run_cli

_NORMANS = (
    "The Normans were the people who in the 10th and 11th centuries gave their name to "
    "Normandy, a region in France. They were descended from Norse raiders and pirates from "
    "Denmark, Iceland and Norway who, under their leader Rollo, agreed to swear fealty to King "
    "Charles III of West Francia."
)


def test_common_words_weigh_nothing_and_rare_ones_decide() -> None:
    assert rarity("the") < COMMON_CB < rarity("raiders") < UNLISTED_CB == rarity("zqxj")
    gate = Scope.of(_NORMANS)
    assert gate.coverage("What is the?") == 0.0  # common words alone name nothing
    assert gate.coverage("Who was Rollo?") == 1.0  # its one rare word is the context's
    own = gate.coverage("Question: Who did Rollo swear fealty to?\nAnswer:")
    general = gate.coverage("Question: What is the capital of Japan?\nAnswer:")
    assert own >= 0.5 > 0.1 > general, (own, general)
    assert gate.admits("Who was Rollo?") and not gate.admits("What is the capital of Japan?")
    # A chat template's own words are not the user's: ignored, they do not dilute the query.
    plain = gate.coverage("In what country is Normandy located?")
    turn = "user\nIn what country is Normandy located?\nassistant\n"
    assert gate.coverage(turn) < plain == gate.coverage(turn, terms("user assistant"))


def test_threshold_zero_admits_every_query_and_bounds_are_refused() -> None:
    assert Scope.of(_NORMANS, 0.0).admits("What is the capital of Japan?")
    for bad in (-0.1, 1.5):
        with pytest.raises(CtxcError, match=r"threshold must be in \[0, 1\]"):
            Scope.of(_NORMANS, bad)
    both = Scope.of("Tokyo is the capital of Japan.").union(Scope.of(_NORMANS))
    assert both.admits("What is the capital of Japan?") and both.admits("Who was Rollo?")


def test_scope_file_round_trip_and_bad_files(tmp_path) -> None:
    gate = Scope.of(_NORMANS, 0.25)
    gate.save(tmp_path)
    assert Scope.load(tmp_path) == gate
    doc = json.loads((tmp_path / SCOPE_FILE).read_text())
    assert doc["common_cb"] == COMMON_CB and "rollo" in doc["words"]
    for change, message in (
        ({"format": "other"}, "format 'other'"),
        ({"common_cb": 1}, "other word weights"),
        ({"threshold": "high"}, "could not convert"),
    ):
        (tmp_path / SCOPE_FILE).write_text(json.dumps({**doc, **change}))
        with pytest.raises(CtxcError, match=message):
            Scope.load(tmp_path)
    with pytest.raises(CtxcError, match=r"has no scope\.json"):
        Scope.load(tmp_path / "nowhere")


def test_router_sends_a_question_outside_the_document_to_no_chunk(tmp_path) -> None:
    texts = (_NORMANS, "Jacksonville is the largest city in Florida by area.")
    router = Router(("000", "001"), texts, {})
    assert router.route("Who was Rollo?") == "000"
    assert router.route("Which is the largest city in Florida?") == "001"
    assert router.route("What is the capital of Japan?") is None
    assert router.pick("What is the capital of Japan?") in router.ids  # ungated: a chunk
    router.save(tmp_path)
    assert Router.load(tmp_path).scope == router.scope
    # A router written before scopes gates nothing, as it was baked to.
    doc = json.loads((tmp_path / "router.json").read_text())
    del doc["scope"]
    (tmp_path / "router.json").write_text(json.dumps(doc))
    old = Router.load(tmp_path)
    assert old.scope is None and old.route("What is the capital of Japan?") in router.ids
    doc["scope"] = {"threshold": "x"}
    (tmp_path / "router.json").write_text(json.dumps(doc))
    with pytest.raises(CtxcError, match="is not a ctxc router"):
        Router.load(tmp_path)


def test_route_command_on_a_bake_folder_prints_it_or_none(tmp_path) -> None:
    Scope.of(_NORMANS).save(tmp_path)
    proc = run_cli("route", str(tmp_path), "--query", "Who was Rollo?")
    assert (proc.returncode, proc.stdout.strip()) == (0, str(tmp_path)), proc
    proc = run_cli("route", str(tmp_path), "--query", "What is the capital of Japan?")
    assert (proc.returncode, proc.stdout.strip()) == (0, "none"), proc
    proc = run_cli("route", str(tmp_path), "--query", "What is the capital of Japan?", "--scores")
    assert proc.stdout.splitlines() == ["coverage\t0.000\t(threshold 0.15)", "none"], proc.stdout
    proc = run_cli("route", str(tmp_path), "--query", "Capital of Japan?", "--no-scope")
    assert proc.stdout.strip() == str(tmp_path), proc
    proc = run_cli("route", str(tmp_path), "--query", "Capital of Japan?", "--threshold", "0")
    assert proc.stdout.strip() == str(tmp_path), proc
    proc = run_cli("route", str(tmp_path), "--query", "Was Rollo a king?", "--threshold", "1")
    assert proc.stdout.strip() == str(tmp_path), proc  # "rollo" is all its information
    proc = run_cli("route", str(tmp_path), "--query", "Rollo of Japan?", "--threshold", "0.9")
    assert proc.stdout.strip() == "none", proc
    proc = run_cli("route", str(tmp_path), "--query", "Rollo?", "--threshold", "2")
    assert proc.returncode == 2 and "--threshold must be in [0, 1]" in proc.stderr, proc
    routed = tmp_path / "routed"
    routed.mkdir()
    Router(("000",), (_NORMANS,), {}).save(routed)
    proc = run_cli("route", str(routed), "--query", "What is the capital of Japan?")
    assert (proc.returncode, proc.stdout.strip()) == (0, "none"), proc
    proc = run_cli("route", str(routed), "--query", "Who was Rollo?")
    assert proc.stdout.strip() == str(routed / "chunks" / "000"), proc
    proc = run_cli("route", str(routed), "--query", "Capital of Japan?", "--threshold", "0")
    assert proc.stdout.strip() == str(routed / "chunks" / "000"), proc
    (tmp_path / SCOPE_FILE).write_text("{")
    proc = run_cli("route", str(tmp_path), "--query", "Who was Rollo?")
    assert proc.returncode == 2 and "is not a ctxc scope" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
