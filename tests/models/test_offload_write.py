"""Writing a dispersed model's folder (backends/torch/shards.py): each unchanged offloaded weight
is copied from its file in chunks, byte for byte; patched ones come from where they live; each
shard's header puts the patched weights at the addresses the solver computed them at."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import ctxc
import ctxc.backends.torch.shards as shards
from ctxc.backends.torch.model import emit_torch, shard_kwargs
from ctxc.backends.torch.shards import copy_range, saved_tensors, shard_header, write_shards
from ctxc.models.offload import read_param, safetensors_header, stored_range
from testbed.tiny_models import build_any, tiny_tokenizer
from tests.fixtures.helpers import diff_msg, full_logits, logits, max_diff, random_ids

pytestmark = pytest.mark.tiny


def _offloaded(folder: Path):
    """(the model in memory, the same model with most of it offloaded to disk)."""
    ref, _ = ctxc.load_model(str(folder))
    size = sum(p.numel() * p.element_size() for p in ref.parameters())
    off, _ = ctxc.load_model(str(folder), device_map="auto", max_memory={"cpu": size // 2})
    return ref, off


def _data(path: Path, name: str) -> bytes:
    """The bytes of tensor ``name`` in safetensors file ``path``."""
    n, header = safetensors_header(str(path))
    begin, end = header[name]["data_offsets"]
    with open(path, "rb") as f:
        f.seek(8 + n + begin)
        return f.read(end - begin)


def test_copy_range_writes_file_identical_tensors_at_the_wanted_addresses(tmp_path):
    tensors = {
        "a": torch.randn(33, 5),
        "b": torch.randn(7, 3).to(torch.bfloat16),
        "c": torch.arange(11, dtype=torch.int64),
        "d": torch.tensor(2.5),
    }
    src = tmp_path / "src.safetensors"
    save_file(tensors, str(src))
    n, header = safetensors_header(str(src))
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    entries = [(k, header[k]["dtype"], header[k]["shape"], tensors[k].nbytes) for k in names]
    for want in (8, 24, 56):
        dst = tmp_path / f"dst{want}.safetensors"
        with open(dst, "wb") as f:
            f.write(shard_header(entries, {"a": want}))
            for k in names:  # 7-byte chunks: no tensor is a whole number of them
                begin, end = header[k]["data_offsets"]
                copy_range(str(src), 8 + n + begin, end - begin, f, chunk=7)
        loaded = load_file(str(dst))
        assert loaded.keys() == tensors.keys()
        for k, v in tensors.items():
            assert torch.equal(loaded[k], v), diff_msg(k, loaded[k].float(), v.float())
            assert _data(dst, k) == _data(src, k), k
        m, out = safetensors_header(str(dst))
        assert (8 + m + out["a"]["data_offsets"][0]) % 64 == want, (want, m, out["a"])
    with open(tmp_path / "short.safetensors", "wb") as f, pytest.raises(OSError, match="ends"):
        copy_range(str(src), src.stat().st_size - 4, 8, f)


def test_offloaded_weights_are_copied_byte_for_byte(tiny_model_dir, tmp_path, monkeypatch):
    ref, off = _offloaded(tiny_model_dir)
    result = ctxc.compile(off, context_ids=random_ids(7, 20))
    copied: list[tuple[str, int, int]] = []

    def counting(src, offset, count, dst, chunk=1 << 10):  # small chunks: many per tensor
        copied.append((src, offset, count))
        copy_range(src, offset, count, dst, chunk)

    monkeypatch.setattr(shards, "copy_range", counting)
    state = saved_tensors(off)
    assert state is not None
    offloaded = {k for k, v in state.items() if v.device.type == "meta"}
    with result.patch.applied(off, check=False):
        assert write_shards(off, tmp_path, shard_kwargs(off)["max_shard_size"], {})
        values = {k: read_param(off, k) if k in offloaded else v for k, v in state.items()}
        stored = {}  # the store's bytes (a patched weight's: the file Patch.apply wrote)
        for k in offloaded:
            src, offset, count = stored_range(off, k, "F32")
            with open(src, "rb") as f:
                f.seek(offset)
                stored[k] = f.read(count)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 2, files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    written = {}
    for path in files:
        for k, v in load_file(str(path)).items():
            written[k] = v
            assert index["weight_map"][k] == path.name, k
            if k in offloaded:
                assert _data(path, k) == stored[k], k
    assert written.keys() == state.keys()
    for k, v in values.items():
        assert torch.equal(written[k], v), diff_msg(k, written[k], v)
    patched_off = [k for k in result.patch.deltas if k in offloaded]
    assert patched_off, "no patched weight is offloaded: the test would not test that path"
    for k in patched_off:
        assert not torch.equal(written[k], ref.get_parameter(k).detach()), k
    assert len(copied) == len(offloaded), (len(copied), len(offloaded))


def test_a_checkpoint_layout_of_its_own_is_saved_by_transformers(tmp_path):
    # Transformers fuses Mixtral's experts at load: the checkpoint's names differ from the
    # modules', and save_pretrained reverts that (write_shards leaves it to it).
    folder = tmp_path / "mixtral"
    build_any("mixtral").save_pretrained(str(folder))
    tiny_tokenizer().save_pretrained(str(folder))
    ref, off = _offloaded(folder)
    assert saved_tensors(off) is None
    result = ctxc.compile(off, context_ids=random_ids(5, 24))
    out = emit_torch(off, None, result.patch, tmp_path / "model")
    plain = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    k = len(result.patch.meta.query_ids)
    full = full_logits(ref, result.patch)
    emitted = logits(plain, result.patch.meta.query_ids)[-k:]
    control = logits(ref, result.patch.meta.query_ids)[-k:]
    assert max_diff(emitted, full) <= 1e-5, diff_msg("emitted vs full", emitted, full)
    assert max_diff(control, full) > 1e-2, diff_msg("control vs full (must differ)", control, full)
