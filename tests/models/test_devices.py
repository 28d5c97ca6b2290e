"""Models bigger than memory (issue 10): a compile of a model dispersed by accelerate, most of
it offloaded to disk, gives the in-memory compile's patch bit for bit, and an exact model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import ctxc
from ctxc.backends.torch.model import emit_torch
from ctxc.models.fingerprint import fingerprint
from ctxc.models.offload import is_dispersed, read_param
from tests.fixtures.helpers import diff_msg, full_logits, logits, max_diff, random_ids

pytestmark = pytest.mark.tiny


def _digest(folder: Path) -> str:
    """sha256 over the folder's safetensors files: the checkpoint is never written."""
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """(the model in memory, the same model with most of it offloaded to disk, tokenizer)."""
    ref, tok = ctxc.load_model(str(tiny_model_dir))
    size = sum(p.numel() * p.element_size() for p in ref.parameters())
    off, _ = ctxc.load_model(str(tiny_model_dir), device_map="auto", max_memory={"cpu": size // 2})
    return ref, off, tok


def test_most_of_the_model_is_offloaded_to_disk(pair):
    ref, off, _ = pair
    assert is_dispersed(off) and not is_dispersed(ref)
    total = sum(p.numel() for p in ref.parameters())
    on_disk = sum(p.numel() for p in off.parameters() if p.device.type == "meta")
    assert on_disk > total / 2, f"{on_disk} of {total} parameters on disk"
    assert {"cpu", "disk"} <= set(off.hf_device_map.values()), off.hf_device_map
    # One accelerate hook per block, not one for the whole model (compiler/models/devices.py).
    assert "" not in off.hf_device_map, off.hf_device_map


def test_offloaded_compile_gives_the_in_memory_patch_bit_for_bit(pair, tiny_model_dir, tmp_path):
    ref, off, tok = pair
    ids = random_ids(5, 24)
    before = _digest(tiny_model_dir)
    want = ctxc.compile(ref, context_ids=ids)
    got = ctxc.compile(off, context_ids=ids)
    assert list(got.patch.deltas) == list(want.patch.deltas)
    for name, d in want.patch.deltas.items():
        g = got.patch.deltas[name]
        assert torch.equal(g.dense(), d.dense()), diff_msg(name, g.dense(), d.dense())
    assert got.patch.meta.fingerprint == want.patch.meta.fingerprint == fingerprint(ref)
    assert got.report.placement.get("disk", 0) > got.report.placement.get("cpu", 0)
    assert got.report.device == "cpu"
    # Written shard by shard (about a block each), loadable by plain Transformers, exact.
    folder = emit_torch(off, tok, got.patch, tmp_path / "model")
    assert len(list(folder.glob("*.safetensors"))) > 2
    plain = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    k = len(got.patch.meta.query_ids)
    full = full_logits(ref, got.patch)  # [k, vocab]
    emitted = logits(plain, got.patch.meta.query_ids)[-k:]
    control = logits(ref, got.patch.meta.query_ids)[-k:]
    assert max_diff(emitted, full) <= 1e-5, diff_msg("emitted vs full", emitted, full)
    assert max_diff(control, full) > 1e-2, diff_msg("control vs full (must differ)", control, full)
    assert got.report.emitted.max_abs_logit_diff <= 1e-5, got.report.emitted
    assert _digest(tiny_model_dir) == before


def test_patch_applies_into_the_offload_store_and_comes_off_exactly(pair):
    ref, off, _ = pair
    result = ctxc.compile(off, context_ids=random_ids(6, 16))
    offloaded = [n for n in result.patch.deltas if off.get_parameter(n).device.type == "meta"]
    assert offloaded, "no patched parameter is offloaded: the test would not test the store"
    with result.patch.applied(off):
        for name in offloaded:
            want = result.patch.deltas[name].materialize(ref.get_parameter(name))
            assert torch.equal(read_param(off, name), want), name
    for name in offloaded:
        assert torch.equal(read_param(off, name), ref.get_parameter(name).detach()), name
    assert fingerprint(off) == fingerprint(ref)


def test_device_errors_are_one_line(tiny_model_dir):
    with pytest.raises(ctxc.CtxcError, match="not available"):
        ctxc.load_model(str(tiny_model_dir), device="cuda:99")
    with pytest.raises(ctxc.CtxcError, match="unknown device 'tpu'"):
        ctxc.load_model(str(tiny_model_dir), device="tpu")
    with pytest.raises(ctxc.CtxcError, match="malformed part 'cpu'"):
        ctxc.load_model(str(tiny_model_dir), device_map="auto", max_memory="cpu")
    model, _ = ctxc.load_model(str(tiny_model_dir), device="cpu")
    with pytest.raises(ctxc.CtxcError, match="not available"):
        ctxc.compile(model, context_ids=random_ids(1, 8), device="cuda:99")
    result = ctxc.compile(model, context_ids=random_ids(1, 8), device="cpu")
    assert result.report.device == "cpu" and result.report.placement == {
        "cpu": sum(p.numel() for p in model.parameters())
    }


def test_realigned_shards_put_each_patched_weight_at_its_address(tmp_path):
    from safetensors.torch import load_file, save_file

    from ctxc.backends.torch.shards import realign_shards

    tensors = {"a": torch.randn(16, 4), "b": torch.randn(3), "c": torch.randn(8, 8)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    for want in (8, 40, 60):
        assert realign_shards(tmp_path, {"c": want}) == 1
        with open(tmp_path / "x.safetensors", "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        assert (8 + n + header["c"]["data_offsets"][0]) % 64 == want, (want, n, header["c"])
        loaded = load_file(str(tmp_path / "x.safetensors"))
        assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert realign_shards(tmp_path, {"c": want}) == 0  # already there: left alone
