"""The gate reads what each artefact's figures declare (issue 37): no table of kinds in core.

``gate`` holds every fidelity an artefact's figures name (``fidelities()``) to the patch's
figure; ``CTXC_TEST_FAIL_CHECK=KIND`` fails the checks met while ``staged`` writes that kind's
artefact, whatever its file's name. Torch tensors only: no model is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from ctxc.core.checks import FAIL_ENV, ArtefactError, CheckFailed, enforce, gate, staged
from ctxc.core.metrics import Fidelity
from ctxc.core.thresholds import RUNTIME_SLACK


def _fid(diff: float) -> Fidelity:
    return Fidelity(diff, diff / 2, 0.0, True, 1, 1)


@dataclass(frozen=True)
class _Figures:
    """Two fidelities, as the PEFT adapter's (as loaded, merged)."""

    lora: Fidelity
    merged: Fidelity

    def fidelities(self) -> dict[str, Fidelity]:
        return {"lora": self.lora, "merged": self.merged}


@dataclass(frozen=True)
class _One:
    fidelity: Fidelity

    def fidelities(self) -> dict[str, Fidelity]:
        return {"fidelity": self.fidelity}


META = SimpleNamespace(dtype="float32", update="stable", solver_max_abs_logit_diff=1e-3)
FULL = torch.tensor([[2.0, -4.0]])  # the bound: 1e-3 + float32's slack * 4
LIMIT = 1e-3 + RUNTIME_SLACK["float32"] * 4.0


def test_every_declared_fidelity_is_held_and_named_when_several() -> None:
    gate("adapter/", _Figures(_fid(LIMIT), _fid(LIMIT)), META, FULL)  # at the bound: passes
    over = LIMIT * 1.5
    with pytest.raises(CheckFailed) as info:
        gate("adapter/", _Figures(_fid(0.0), _fid(over)), META, FULL)
    want = (
        f"adapter/ check failed: max |logit diff| from the full context (merged) {over:.3g} > "
        f"{LIMIT:.3g} (the solver's 0.001 + the runtime's slack)"
    )
    assert str(info.value) == want, f"{info.value} != {want}"
    with pytest.raises(CheckFailed, match=r"^model\.onnx check failed: max \|logit diff\| from "):
        gate("model.onnx", _One(_fid(over)), META, FULL)  # one fidelity: no name shown


def test_a_rounding_type_widens_the_bound() -> None:
    figures = _One(_fid(LIMIT * 1.5))
    with pytest.raises(CheckFailed):
        gate("model.gguf", figures, META, FULL)
    gate("model.gguf", figures, META, FULL, gguf_type="F16")  # float16's slack: wider


def test_a_forced_kind_fails_the_checks_met_while_it_is_staged(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(FAIL_ENV, "ort-adapter")
    enforce("patchable.onnx", "figure", 0.0, 1.0)  # outside its staging: not forced
    with pytest.raises(ArtefactError) as info, staged(tmp_path, "ort-adapter", "x") as sub:
        (sub / "patchable.onnx").write_text("")
        enforce("patchable.onnx", "figure", 0.0, 1.0)
    want = "patchable.onnx check failed: figure 0 > 1 (forced by CTXC_TEST_FAIL_CHECK=ort-adapter)"
    assert str(info.value) == want, str(info.value)
    assert list(tmp_path.iterdir()) == [], "a failed artefact leaves nothing"
    with staged(tmp_path, "onnx", "model.onnx") as sub:  # another kind: not forced
        enforce("model.onnx", "figure", 0.0, 1.0)
        (sub / "model.onnx").write_text("")
    enforce("patchable.onnx", "figure", 0.0, 1.0)  # the staging is over: not forced
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]
