"""The torch backend writes the patched weights without writing, cloning or moving the model's own
(``patched_values``, issue 11): the saved tensors are Patch.apply's, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import ctxc
from ctxc.backends.torch.model import emit_torch
from ctxc.runs.patched_forward import patched_values
from testbed.tiny_models import shared
from tests.fixtures.helpers import random_ids

pytestmark = pytest.mark.tiny
# The session's ``shared`` tiny Gemma 3 (seed 0, as ``build``), built and traced once instead of
# once a test: every test leaves it as it was (the first and second check that they do).


def _saved(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_emit_torch_saves_the_applied_weights_and_leaves_the_model(tmp_path) -> None:
    model = shared("gemma3")
    patch = ctxc.compile(model, context_ids=random_ids(4, 20), verify=False).patch
    before = {k: v.clone() for k, v in model.state_dict().items()}
    addresses = {k: v.data_ptr() for k, v in model.state_dict().items()}

    emit_torch(model, None, patch, tmp_path / "new")
    with patch.applied(model):  # the reference: the weights written into the model in place
        model.save_pretrained(str(tmp_path / "applied"))

    new, applied = _saved(tmp_path / "new"), _saved(tmp_path / "applied")
    assert sorted(new) == sorted(applied)
    differ = [k for k in new if not torch.equal(new[k], applied[k])]
    assert not differ, f"{len(differ)} tensors differ from Patch.apply's, e.g. {differ[:2]}"
    changed = [k for k in patch.deltas if not torch.equal(new[k], before[k])]
    assert len(changed) == len(patch.deltas), f"{len(changed)} of {len(patch.deltas)} patched"
    kept = [k for k, v in model.state_dict().items() if not torch.equal(before[k], v)]
    assert not kept, f"emit_torch left the model modified: {kept[:3]}"
    moved = [k for k, v in model.state_dict().items() if v.data_ptr() != addresses[k]]
    assert not moved, f"emit_torch left parameters at other addresses: {moved[:3]}"


def test_patched_values_are_the_applied_logits_and_restore_on_error() -> None:
    model = shared("gemma3")
    ids = random_ids(5, 16)
    patch = ctxc.compile(model, context_ids=ids, verify=False).patch
    query = torch.tensor([patch.meta.query_ids])
    with patch.applied(model), torch.no_grad():
        want = model(input_ids=query).logits
    for _ in range(2):  # twice: the first swap must leave the model as it found it
        with patched_values(model, patch), torch.no_grad():
            got = model(input_ids=query).logits
        diff = (got - want).abs()
        assert torch.equal(got, want), f"max {diff.max():.3g}, mean {diff.mean():.3g}"
    name = next(iter(patch.deltas))
    param = model.get_parameter(name)
    own, address = param.detach().clone(), param.data_ptr()
    try:
        with patched_values(model, patch):
            assert param.data_ptr() != address, "the patched value is swapped in"
            raise RuntimeError("stop")
    except RuntimeError:
        pass
    assert param.data_ptr() == address, "the parameter's own tensor is back"
    assert torch.equal(param.detach(), own), f"max {(param.detach() - own).abs().max():.3g}"


def test_a_marked_tokenizer_is_copied_and_any_other_is_saved(tmp_path) -> None:
    from transformers import AutoTokenizer

    from ctxc.backends.torch.model import save_tokenizer
    from testbed.tiny_models import tiny_tokenizer

    source = tmp_path / "source"
    tiny_tokenizer().save_pretrained(str(source))
    # Compact JSON: Transformers writes its own (indented), so a copy is told from a save.
    full = source / "tokenizer.json"
    full.write_text(json.dumps(json.loads(full.read_text()), separators=(",", ":")))
    tok = AutoTokenizer.from_pretrained(str(source))
    names = sorted(p.name for p in source.iterdir())

    saved = tmp_path / "saved"
    saved.mkdir()
    save_tokenizer(tok, saved)  # unmarked: Transformers writes it
    assert (saved / "tokenizer.json").read_bytes() != full.read_bytes()

    tok.ctxc_files = source
    copied = tmp_path / "copied"
    copied.mkdir()
    save_tokenizer(tok, copied)
    assert sorted(p.name for p in copied.iterdir()) == names
    same = [n for n in names if (copied / n).read_bytes() == (source / n).read_bytes()]
    assert same == names, f"copied {same} of {names}"
    again = AutoTokenizer.from_pretrained(str(copied))
    text = "w1 w2 w3 hello"
    assert again(text).input_ids == tok(text).input_ids

    (source / "tokenizer_config.json").unlink()  # not a tokenizer folder any more: saved
    fallback = tmp_path / "fallback"
    fallback.mkdir()
    save_tokenizer(tok, fallback)
    assert (fallback / "tokenizer_config.json").is_file()


def test_two_writers_write_the_bytes_of_one(tmp_path, monkeypatch) -> None:
    from ctxc.backends.torch import shards as torch_shards

    model = shared("gemma3")
    monkeypatch.setattr(torch_shards, "_CHUNK", 256)  # many pieces per tensor, split anywhere
    one, two = tmp_path / "one", tmp_path / "two"
    for folder, workers in ((one, 1), (two, 2)):
        folder.mkdir()
        assert torch_shards.write_shards(model, folder, 1 << 62, {}, workers=workers)
    assert sorted(p.name for p in two.iterdir()) == ["model.safetensors"]
    a, b = (f.joinpath("model.safetensors").read_bytes() for f in (one, two))
    assert a == b, f"{len(a)} vs {len(b)} bytes; first difference at {_first_difference(a, b)}"
    saved = _saved(two)
    state = model.state_dict()
    differ = [k for k, v in saved.items() if not torch.equal(v, state[k])]
    assert not differ, f"{len(differ)} of {len(saved)} tensors differ, e.g. {differ[:2]}"


def _first_difference(a: bytes, b: bytes) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def test_reference_logits_holds_only_the_query_rows() -> None:
    """``reference_logits`` keeps k rows, not a view into the [n, vocab] logits of the whole
    context + query (at 14k tokens and a 262k vocabulary those are 15 GB held for k rows)."""
    from ctxc.backends.reference import reference_logits

    model = shared("gemma3")
    patch = ctxc.compile(model, context_ids=random_ids(6, 40), verify=False).patch
    got = reference_logits(model, patch)
    assert got.shape[0] == len(patch.meta.query_ids)
    held = got.untyped_storage().nbytes()
    assert held == got.numel() * got.element_size(), f"{held} bytes held for {got.numel()} values"
