"""The patch digest covers the metadata too (issue 34): an edited ``query_ids`` (or rule, or
fingerprint) is refused on load in one line, before any model loads, where it was found only as
a failed artefact check a minute later; a patch written before the digest still loads. Quick
tier: the patch is made by hand, no model is built."""

from __future__ import annotations

import json

import pytest
import torch

from ctxc.core.errors import CtxcError
from ctxc.patch import Delta, Patch, PatchMeta


def _patch() -> Patch:
    g = torch.Generator().manual_seed(0)
    delta = Delta(
        param="model.layers.0.mlp.down_proj.weight",
        block="model.layers.0.mlp",
        u=torch.randn(6, 1, generator=g),
        v=torch.randn(4, 1, generator=g),
    )
    meta = PatchMeta(
        fingerprint={"arch": "a" * 64, "weights": "b" * 64},
        context_ids=[1, 5, 6, 7],
        query_ids=[8],
        update="stable",
        dtype="float32",
        ctxc_version="0",
        solver_max_abs_logit_diff=1e-6,
    )
    return Patch({delta.param: delta}, meta)


def _rewrite(src, dst, change) -> None:
    """``src`` written again as ``dst`` with its metadata changed by ``change``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    change(meta)
    save_file(tensors, str(dst), metadata=meta)


@pytest.mark.parametrize(
    ("key", "value"),
    [("query_ids", "[9]"), ("update", "output"), ("solver_max_abs_logit_diff", "1.0")],
)
def test_edited_metadata_is_refused_on_load(tmp_path, key, value) -> None:
    path = _patch().save(tmp_path / "patch.safetensors")
    assert Patch.load(path).meta.query_ids == [8]  # the untouched file loads
    edited = tmp_path / "edited.safetensors"
    _rewrite(path, edited, lambda meta: meta.__setitem__(key, value))
    with pytest.raises(CtxcError) as caught:
        Patch.load(edited)
    assert str(caught.value) == (
        f"patch {edited}: its metadata (token ids, rule, fingerprint, ...) do not match the "
        "digest ctxc stored (the file was changed after it was written)"
    )


def test_a_patch_from_before_the_digest_still_loads(tmp_path) -> None:
    """Written before ``metadata_sha256`` existed (its tensors' digest only): loads, and the
    tensors are still checked; a file with neither digest loads too (as before)."""
    path = _patch().save(tmp_path / "patch.safetensors")
    older = tmp_path / "older.safetensors"
    _rewrite(path, older, lambda meta: meta.pop("metadata_sha256"))
    assert Patch.load(older).meta.query_ids == [8]
    oldest = tmp_path / "oldest.safetensors"
    _rewrite(older, oldest, lambda meta: meta.pop("tensors_sha256"))
    assert Patch.load(oldest).meta.query_ids == [8]


def test_export_refuses_an_edited_patch_before_the_model_loads(tmp_path, monkeypatch) -> None:
    import ctxc.models.load as load
    from tests.fixtures.helpers import run_cli

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(load, "load_model", refuse)
    path = _patch().save(tmp_path / "patch.safetensors")
    _rewrite(path, tmp_path / "edited.safetensors", lambda m: m.update(query_ids=json.dumps([9])))
    run = run_cli("export", "--patch", "edited.safetensors", "--to", "torch", "--out", "x",
                  cwd=tmp_path)  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        "ctxc: error: patch edited.safetensors: its metadata (token ids, rule, fingerprint, ...) "
        "do not match the digest ctxc stored (the file was changed after it was written)"
    ]
    assert not (tmp_path / "x").exists()
