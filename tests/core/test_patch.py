"""The Patch: safetensors round trip, exact apply/remove, fingerprint checks."""

from __future__ import annotations

import pytest
import torch

import ctxc
from ctxc.models.fingerprint import fingerprint
from testbed.tiny_models import build

pytestmark = pytest.mark.tiny  # a module fixture compiles a tiny model


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


# -- validation, check, applied, bytes (issue 15, items 6 and 9) -----------------------------


def _rewrite(src, dst, change=None, meta_change=None):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if change:
        change(tensors)
    if meta_change:
        meta_change(meta)
    save_file(tensors, str(dst), metadata=meta)
    return dst


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_values_are_refused_naming_the_tensor(compiled, tmp_path, value) -> None:
    _, result = compiled
    path = result.patch.save(tmp_path / "patch.safetensors")
    name = "model.layers.1.mlp.down_proj.weight::u"

    def poison(tensors):
        tensors[name][3, 0] = value

    bad = _rewrite(path, tmp_path / "bad.safetensors", poison)
    with pytest.raises(ctxc.CtxcError) as info:
        ctxc.Patch.load(bad)
    assert str(info.value) == f"patch {bad}: tensor {name!r} has 1 non-finite value(s) (NaN or Inf)"


def test_inconsistent_factors_are_refused(compiled, tmp_path) -> None:
    _, result = compiled
    path = result.patch.save(tmp_path / "patch.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"

    def widen(tensors):
        tensors[f"{name}::u"] = torch.zeros(tensors[f"{name}::u"].shape[0], 2)

    bad = _rewrite(path, tmp_path / "bad.safetensors", widen)
    with pytest.raises(ctxc.CtxcError) as info:
        ctxc.Patch.load(bad)
    assert str(info.value) == f"patch {bad}: tensors '{name}::u'/'::v' have ranks 2 and 1"


def test_malformed_fingerprint_is_refused(compiled, tmp_path) -> None:
    _, result = compiled
    path = result.patch.save(tmp_path / "patch.safetensors")

    def drop(meta):
        meta["fingerprint"] = '{"arch": "x"}'

    bad = _rewrite(path, tmp_path / "bad.safetensors", meta_change=drop)
    with pytest.raises(ctxc.CtxcError, match="malformed fingerprint"):
        ctxc.Patch.load(bad)


def test_check_refuses_a_shape_mismatch_without_applying(compiled) -> None:
    model, result = compiled
    result.patch.check(model)  # fits
    name = "model.layers.0.mlp.up_proj.weight"
    d = result.patch.deltas[name]
    bigger = ctxc.Delta(name, d.block, u=torch.zeros(d.u.shape[0] + 1, 1), v=d.v[:, :1])
    wrong = ctxc.Patch({**result.patch.deltas, name: bigger}, result.patch.meta)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ctxc.CtxcError) as info:
        wrong.check(model)
    shape = list(model.get_parameter(name).shape)
    assert str(info.value) == (
        f"tensor {name!r}: delta shape {[shape[0] + 1, shape[1]]} differs from the model's {shape}"
    )
    assert not ctxc.Patch.is_applied(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_applied_always_removes(compiled) -> None:
    model, result = compiled
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match="boom"), result.patch.applied(model):
        assert ctxc.Patch.is_applied(model)
        raise RuntimeError("boom")
    assert not ctxc.Patch.is_applied(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_identical_inputs_give_byte_identical_files(compiled, tmp_path) -> None:
    model, result = compiled
    ids = result.patch.meta.context_ids + result.patch.meta.query_ids
    again = ctxc.compile(model, context_ids=ids)
    a = result.patch.save(tmp_path / "a.safetensors").read_bytes()
    b = again.patch.save(tmp_path / "b.safetensors").read_bytes()
    assert a == b
    # safetensors' own save_file orders the metadata by hash: the header must be sorted here.
    import json
    import struct

    (n,) = struct.unpack("<Q", a[:8])
    header = json.loads(a[8 : 8 + n])
    assert list(header["__metadata__"]) == sorted(header["__metadata__"])


def test_patch_folder_is_accepted(compiled, tmp_path) -> None:
    _, result = compiled
    result.patch.save(tmp_path / "patch.safetensors")
    assert ctxc.Patch.load(tmp_path).meta == result.patch.meta
    (tmp_path / "empty").mkdir()
    with pytest.raises(ctxc.CtxcError, match=r"holds no patch\.safetensors"):
        ctxc.Patch.load(tmp_path / "empty")


def test_context_past_the_positions_is_refused_before_any_run() -> None:
    model = build("llama")  # 256 positions
    with pytest.raises(ctxc.CtxcError) as info:
        ctxc.compile(model, context_ids=list(range(4, 4 + 100)) * 3)
    assert str(info.value) == (
        "context + query is 300 tokens; the model takes at most 256 positions "
        "(max_position_embeddings)"
    )


def test_positions_are_found_in_a_text_config() -> None:
    from types import SimpleNamespace

    from ctxc.models.load import max_positions

    multimodal = SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=512))
    assert max_positions(multimodal) == (512, "max_position_embeddings")
    assert max_positions(SimpleNamespace(n_positions=1024)) == (1024, "n_positions")
    assert max_positions(SimpleNamespace()) is None


def test_rank_past_its_bounds_is_refused(compiled, tmp_path) -> None:
    _, result = compiled
    path = result.patch.save(tmp_path / "patch.safetensors")
    name = "model.layers.2.mlp.gate_proj.weight"

    def inflate(tensors):  # hidden 64, intermediate 128, one query token: rank 65 is no patch
        tensors[f"{name}::u"] = torch.zeros(128, 65)
        tensors[f"{name}::v"] = torch.zeros(64, 65)

    bad = _rewrite(path, tmp_path / "bad.safetensors", inflate)
    with pytest.raises(ctxc.CtxcError) as info:
        ctxc.Patch.load(bad)
    assert str(info.value) == f"patch {bad}: tensor '{name}::u' has rank 65, outside 1..64"
