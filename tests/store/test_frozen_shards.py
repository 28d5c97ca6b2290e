"""An opted-in model's ``model/`` folder: its unpatched weights one cache file, hard-linked
(compiler/store/frozen_shards.py, issue 33). The folder loads as the one-file folder does, bit for
bit; an entry overwritten through a link is rewritten, never reused; off, one file as before."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import ctxc
from ctxc.backends.torch.model import emit_torch
from ctxc.store import frozen_shards
from testbed.tiny_models import build
from tests.fixtures.helpers import random_ids

pytestmark = pytest.mark.tiny

_SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.fixture(scope="module")
def tiny_patch():
    """A tiny Gemma 3 and its patch, compiled once for the module."""
    model = build("gemma3")
    patch = ctxc.compile(model, context_ids=random_ids(4, 20), verify=False).patch
    return model, patch


@pytest.fixture
def compiled(tiny_patch, tmp_path, monkeypatch):
    """The tiny model (not opted in), its patch, and a private cache."""
    monkeypatch.setenv("CTXC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CTXC_FROZEN_SHARDS", raising=False)
    model, patch = tiny_patch
    frozen_shards.enable(model, False)
    yield model, patch
    frozen_shards.enable(model, False)


def _weights(folder) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _logits(folder, query: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([query])).logits[0]


def test_two_folders_share_one_entry_and_load_as_the_one_file(compiled, tmp_path) -> None:
    model, patch = compiled
    emit_torch(model, None, patch, tmp_path / "one")  # not opted in: one file
    frozen_shards.enable(model)
    for name in ("a", "b"):  # twice: the second reuses the entry the first wrote
        emit_torch(model, None, patch, tmp_path / name)
    assert sorted(p.name for p in (tmp_path / "one").glob("*.safetensors")) == ["model.safetensors"]
    entries = list((tmp_path / "cache" / "frozen").glob("*.safetensors"))
    assert len(entries) == 1, entries
    for name in ("a", "b"):
        folder = tmp_path / name
        assert sorted(p.name for p in folder.glob("*.safetensors")) == _SHARDS
        assert (folder / _SHARDS[0]).stat().st_ino == entries[0].stat().st_ino, "not linked"
    one, a = _weights(tmp_path / "one"), _weights(tmp_path / "a")
    assert sorted(one) == sorted(a)
    differ = [k for k in one if not torch.equal(one[k], a[k])]
    assert not differ, f"{len(differ)} of {len(one)} tensors differ, e.g. {differ[:2]}"
    frozen = load_file(str(tmp_path / "a" / _SHARDS[0]))
    assert not set(frozen) & set(patch.deltas), "a patched weight in the shared shard"
    assert len(load_file(str(tmp_path / "a" / _SHARDS[1]))) == len(patch.deltas)
    want = _logits(tmp_path / "one", patch.meta.query_ids)
    for name in ("a", "b"):
        got = _logits(tmp_path / name, patch.meta.query_ids)
        diff = (got - want).abs()
        assert torch.equal(got, want), f"{name}: max {diff.max():.3g}, mean {diff.mean():.3g}"


def test_an_entry_written_through_a_link_is_rewritten(compiled, tmp_path) -> None:
    model, patch = compiled
    frozen_shards.enable(model)
    emit_torch(model, None, patch, tmp_path / "a")
    linked = tmp_path / "a" / _SHARDS[0]
    entry = next((tmp_path / "cache" / "frozen").glob("*.safetensors"))
    good = entry.read_bytes()
    os.chmod(linked, 0o644)  # as a user saving over the folder would, through the link
    with open(linked, "r+b") as f:
        f.seek(len(good) - 8)
        f.write(b"\xff" * 8)
    assert entry.read_bytes() != good, "the link did not share the entry"
    emit_torch(model, None, patch, tmp_path / "b")
    assert entry.read_bytes() == good, "the overwritten entry was reused"
    assert (tmp_path / "b" / _SHARDS[0]).stat().st_ino != linked.stat().st_ino
    assert oct(entry.stat().st_mode & 0o777) == oct(0o444)


def test_turned_off_writes_one_file(compiled, tmp_path, monkeypatch) -> None:
    model, patch = compiled
    frozen_shards.enable(model)
    monkeypatch.setenv("CTXC_FROZEN_SHARDS", "0")
    emit_torch(model, None, patch, tmp_path / "off")
    assert sorted(p.name for p in (tmp_path / "off").glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "cache" / "frozen").exists()


def test_across_file_systems_the_shard_is_copied(compiled, tmp_path, monkeypatch) -> None:
    model, patch = compiled
    frozen_shards.enable(model)

    def refuse(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", refuse)
    emit_torch(model, None, patch, tmp_path / "a")
    entry = next((tmp_path / "cache" / "frozen").glob("*.safetensors"))
    copied = tmp_path / "a" / _SHARDS[0]
    assert copied.stat().st_ino != entry.stat().st_ino
    assert copied.read_bytes() == entry.read_bytes()
