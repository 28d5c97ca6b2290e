"""What a model writes from its prefix alone, stored (compiler/store/model_writing.py, issue 55):
an opted-in model's off-topic texts are written once and read back the same; another request,
model or a damaged entry writes them anew; not opted in or turned off, nothing is stored."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ctxc.bake import data, folder
from ctxc.store import model_writing
from testbed.tiny_models import build, tiny_tokenizer

pytestmark = pytest.mark.tiny


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A private cache, the store on."""
    monkeypatch.setenv("CTXC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CTXC_WRITING_CACHE", raising=False)
    return tmp_path / "cache" / "writing"


class _Writer:
    """A ``write`` that counts its calls."""

    def __init__(self, texts: list[str]):
        self.texts, self.calls = texts, 0

    def __call__(self) -> dict[str, list[str]]:
        self.calls += 1
        return {"texts": list(self.texts)}


def test_an_opted_in_model_writes_once_and_reads_back_the_same(store) -> None:
    model = build("llama")
    model_writing.enable(model)
    write = _Writer(["one text", "another"])
    first = model_writing.stored_writing(model, {"seed": 5}, [data], write)
    again = model_writing.stored_writing(model, {"seed": 5}, [data], write)
    assert first == again == {"texts": ["one text", "another"]}, (first, again)
    assert write.calls == 1, f"written {write.calls} times"
    assert len(list(store.glob("*.json"))) == 1, sorted(p.name for p in store.iterdir())
    # Another request, another model: written anew, each its own entry.
    model_writing.stored_writing(model, {"seed": 6}, [data], write)
    other = build("llama", seed=1)
    model_writing.enable(other)
    model_writing.stored_writing(other, {"seed": 5}, [data], write)
    assert write.calls == 3, f"written {write.calls} times"
    assert len(list(store.glob("*.json"))) == 3, sorted(p.name for p in store.iterdir())


@pytest.mark.parametrize("damage", ["truncated", "other key", "not strings"])
def test_a_damaged_entry_is_written_anew_never_trusted(store, damage: str) -> None:
    model = build("llama")
    model_writing.enable(model)
    write = _Writer(["kept"])
    model_writing.stored_writing(model, {"seed": 5}, [data], write)
    (entry,) = store.glob("*.json")
    text = entry.read_text()
    if damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    elif damage == "other key":
        entry.write_text(json.dumps({**json.loads(text), "key": "0" * 64}))
    else:
        entry.write_text(json.dumps({**json.loads(text), "writing": {"texts": [1, 2]}}))
    got = model_writing.stored_writing(model, {"seed": 5}, [data], write)
    assert got == {"texts": ["kept"]} and write.calls == 2, (got, write.calls)
    assert json.loads(entry.read_text())["writing"] == {"texts": ["kept"]}, entry.read_text()


def test_not_opted_in_or_turned_off_nothing_is_stored(store, monkeypatch) -> None:
    model = build("llama")
    model_writing.enable(model, False)
    write = _Writer(["x"])
    model_writing.stored_writing(model, {"seed": 5}, [data], write)
    model_writing.enable(model)
    monkeypatch.setenv("CTXC_WRITING_CACHE", "0")
    model_writing.stored_writing(model, {"seed": 5}, [data], write)
    model_writing.stored_writing(model, {"seed": 5}, [data], write)
    assert write.calls == 3 and not store.exists(), (write.calls, store.exists())


def test_the_off_topic_set_is_the_same_stored_or_written(store) -> None:
    """A bake's off-topic set: the stored texts are the ones the model writes (no generation
    the second time: the sampler is not called)."""
    model, tok = build("llama"), tiny_tokenizer()
    model_writing.enable(model)
    result = SimpleNamespace(data=SimpleNamespace(prefix=[tok.bos_token_id]), chat=None)

    def held(texts, *_args):
        return list(texts)

    cold = folder._off_topic_set(model, tok, result, 3, 0, held)
    calls = []
    real = data.sample_continuations
    data.sample_continuations = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        warm = folder._off_topic_set(model, tok, result, 3, 0, held)
    finally:
        data.sample_continuations = real
    model_writing.enable(model, False)
    fresh = folder._off_topic_set(model, tok, result, 3, 0, held)
    assert cold == warm == fresh and len(cold) >= 3, (cold, warm, fresh)
    assert not calls, f"the sampler ran {len(calls)} times on a stored entry"
