"""The tokenizer a command reads before the model loads is handed to that load, once (issue 55:
a 262k-token vocabulary took 2-3 s to read, twice per ``ctxc bake``)."""

from __future__ import annotations

import pytest

from ctxc.models.load import load_model, load_tokenizer

pytestmark = pytest.mark.tiny


def test_the_checked_tokenizer_is_the_loaded_models_once(tiny_model_dir):
    checked = load_tokenizer(str(tiny_model_dir))
    _, first = load_model(str(tiny_model_dir))
    _, second = load_model(str(tiny_model_dir))
    assert first is checked, "the model load read the tokenizer again"
    assert second is not checked, "two model loads share one tokenizer"
    text = "w1 w2 w3"
    assert second(text).input_ids == checked(text).input_ids


def test_the_hand_off_keeps_one_slot(tiny_model_dir, tmp_path):
    """A tokenizer no model load took is dropped when another folder's is read."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    first = load_tokenizer(str(tiny_model_dir))
    load_tokenizer(str(other))
    _, loaded = load_model(str(tiny_model_dir))
    assert loaded is not first, "a tokenizer read before another folder's was handed over"
