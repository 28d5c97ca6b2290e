"""The backend registry (issue 22): every backend an ``Emitter``, torch among them with its reload
check, one emit loop for compile, export and bake (``ctxc.backends.emit_checked``)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import ctxc
from ctxc.backends import BACKENDS, emit_checked
from ctxc.core.checks import ArtefactError
from ctxc.patch import Patch
from testbed.tiny_models import shared, tiny_tokenizer
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import random_ids


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=needs_extra(b.extra)) for n, b in BACKENDS.items()]
)
def test_every_emitter_takes_what_the_registry_passes(name) -> None:
    b = BACKENDS[name]
    for variant in {b.load(False), b.load(True)}:
        params = inspect.signature(variant).parameters
        assert list(params)[:3] in (["model", "patch", "out"], ["model", "patch", "out_dir"]), list(
            params
        )
        missing = {"full", *b.takes} - set(params)
        assert not missing, f"{name}: {variant.__name__} lacks {missing}"


@pytest.mark.tiny
def test_torch_is_written_reloaded_and_gated(tmp_path) -> None:
    model = shared("gemma3")  # built and traced once a session; left as it was
    result = ctxc.compile(model, context_ids=random_ids(4, 20), verify=False)
    figures = emit_checked(model, result.patch, tmp_path, ["torch"], tokenizer=tiny_tokenizer())
    found = figures["torch"]
    assert (tmp_path / "model" / "config.json").is_file()
    assert found.measured_on == "model/ reloaded with AutoModelForCausalLM.from_pretrained"
    assert found.reloaded.max_abs_logit_diff <= 1e-4, found.reloaded
    assert found.vs_patched is None  # held to the solver's figure by the gate instead
    data = found.to_dict()
    assert set(data) == {"emitted", "emitted_measured_on"} and "reference" in data["emitted"]
    alone = tmp_path / "alone"
    alone.mkdir()
    emit_checked(model, result.patch, alone, ["torch"], folder="")  # ctxc export --to torch
    assert (alone / "config.json").is_file() and not (alone / "model").exists()


@pytest.mark.tiny
def test_a_patch_without_solver_figure_is_held_to_the_patched_model(tmp_path, monkeypatch):
    """A baked thought patch has no solver figure: model/ reloaded is held to the patched
    model in memory (ctxc bake --emit torch wrote it unchecked before)."""
    model = shared("gemma3")  # built and traced once a session; left as it was
    patch = ctxc.compile(model, context_ids=random_ids(5, 20), verify=False).patch
    meta = dataclasses.replace(patch.meta, update="bake-fit", solver_max_abs_logit_diff=None)
    baked = Patch(patch.deltas, meta)
    found = emit_checked(model, baked, tmp_path, ["torch"])["torch"]
    assert found.vs_patched is not None and found.vs_patched <= 1e-4, found
    monkeypatch.setenv("CTXC_TEST_FAIL_CHECK", "torch")
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(ArtefactError, match=r"^model/ check failed: max \|logit diff\| from the"):
        emit_checked(model, baked, again, ["torch"])
    assert list(again.iterdir()) == [], "a failed artefact leaves nothing"


@pytest.mark.tiny
@needs_extra("peft")
def test_torch_goes_first_and_its_figure_is_the_reload(tmp_path) -> None:
    model = shared("gemma3")  # built and traced once a session; left as it was
    result = ctxc.compile(model, context_ids=random_ids(6, 20), verify=False)
    kinds = ["peft", "torch"]
    figures = emit_checked(model, result.patch, tmp_path, kinds, full=result.full_logits)
    assert list(figures) == ["torch", "peft"]
    got = figures["torch"].reloaded.max_abs_logit_diff
    want = result.report.emitted.max_abs_logit_diff  # the solver's pass: same weights
    assert abs(got - want) <= 1e-4, f"model/ reloaded {got:.3g}, the solver's pass {want:.3g}"
