"""The Patch: safetensors round trip, exact apply/remove, fingerprint checks."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build

import ctxc
from ctxc.fingerprint import fingerprint


@pytest.fixture(scope="module")
def compiled():
    model = build("gemma3")
    ids = torch.randint(4, 128, (14,), generator=torch.Generator().manual_seed(0)).tolist()
    return model, ctxc.compile(model, context_ids=ids)


def test_save_load_round_trip(compiled, tmp_path) -> None:
    _, result = compiled
    path = result.patch.save(tmp_path / "patch.safetensors")
    loaded = ctxc.Patch.load(path)
    assert loaded.meta == result.patch.meta
    assert list(loaded.deltas) == list(result.patch.deltas)
    for name, d in result.patch.deltas.items():
        assert torch.equal(loaded.deltas[name].dense(), d.dense()), name
    # 3 blocks x (gate, up, post-norm scale, down under the stable rule)
    assert len(loaded.deltas) == 12


def test_apply_gives_the_solver_weights_and_remove_restores_exactly(compiled) -> None:
    model, result = compiled
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result.patch.apply(model)
    changed = [k for k in before if not torch.equal(before[k], model.state_dict()[k])]
    assert sorted(changed) == sorted(result.patch.deltas), changed
    with pytest.raises(ctxc.CtxcError, match="already applied"):
        result.patch.apply(model)
    result.patch.remove(model)
    after = model.state_dict()
    diffs = {k: float((before[k] - after[k]).abs().max()) for k in before}
    assert all(v == 0.0 for v in diffs.values()), f"max diff {max(diffs.values())}"
    with pytest.raises(ctxc.CtxcError, match="no patch"):
        result.patch.remove(model)


def test_fingerprint_mismatch_is_refused(compiled) -> None:
    _, result = compiled
    other = build("gemma3", seed=1)
    with pytest.raises(ctxc.CtxcError, match="weights fingerprint differs"):
        result.patch.apply(other)
    with pytest.raises(ctxc.CtxcError, match="architecture fingerprint differs"):
        result.patch.apply(build("llama"))


def test_fingerprint_tells_dtypes_apart() -> None:
    model = build("llama")
    a = fingerprint(model)
    b = fingerprint(model.to(torch.bfloat16))
    assert a["arch"] == b["arch"] and a["weights"] != b["weights"]


def test_norms_match_dense_deltas(compiled) -> None:
    _, result = compiled
    for name, norm in result.patch.norms().items():
        dense = float(result.patch.deltas[name].dense().norm())
        assert abs(norm - dense) <= 1e-4 * max(1.0, dense), (name, norm, dense)


def test_not_a_patch_file(tmp_path) -> None:
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"not safetensors")
    with pytest.raises(ctxc.CtxcError, match="not a readable safetensors"):
        ctxc.Patch.load(bad)
    with pytest.raises(ctxc.CtxcError, match="not found"):
        ctxc.Patch.load(tmp_path / "missing.safetensors")
