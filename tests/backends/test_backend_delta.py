"""The ``safetensors-delta`` backend (issue 37): the patch as dense weight deltas, one tensor per
patched parameter, that plain safetensors and torch add to the base model; checked added so,
against ctxc's patched model, by a check that fails when the file is wrong."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ctxc
from ctxc.backends import emit_checked
from ctxc.backends.delta.deltas import APPLY, DELTAS_FILE, check_deltas, write_deltas
from ctxc.backends.thresholds import RELOAD_ATOL
from ctxc.core.checks import ArtefactError, CheckFailed
from ctxc.core.errors import CtxcError
from ctxc.runs.patched_forward import patched_logits
from testbed.tiny_models import shared
from tests.fixtures.helpers import random_ids

KIND = "safetensors-delta"


def _compiled(family: str, seed: int = 4):
    """The session's ``shared`` tiny model (seed 0; built and traced once, where each test built
    and traced its own: none changes it, the hand-made copy is a deepcopy) and a compile of
    context ``seed``."""
    model = shared(family)
    return model, ctxc.compile(model, context_ids=random_ids(seed, 20), verify=False)


@pytest.mark.tiny
@pytest.mark.parametrize("family", ["gemma3", "gpt2", "mixtral"])  # Linear, Conv1D, expert bank
def test_the_deltas_reproduce_the_patched_model_bit_for_bit(family, tmp_path) -> None:
    model, result = _compiled(family)
    figures = emit_checked(model, result.patch, tmp_path, [KIND], full=result.full_logits)
    found = figures[KIND]
    deltas = load_file(str(tmp_path / DELTAS_FILE))
    assert sorted(deltas) == sorted(result.patch.deltas), sorted(deltas)
    for name, tensor in deltas.items():
        shape = tuple(model.get_parameter(name).shape)
        assert tuple(tensor.shape) == shape and tensor.dtype == torch.float32, (name, shape)
    assert found.tensors == len(deltas) and found.applied_vs_patched == 0.0, found
    assert found.fidelities() == {"applied": found.applied}
    with safe_open(str(tmp_path / DELTAS_FILE), "pt") as f:
        assert f.metadata()["apply"] == APPLY, f.metadata()
    banks = [d for d in result.patch.deltas.values() if d.experts]
    if family == "mixtral":  # the whole bank, zero for the experts the patch leaves alone
        assert banks, "the mixtral patch changes no expert bank: the bank path is untested"
        d = banks[0]
        left = [e for e in range(deltas[d.param].shape[0]) if e not in d.experts]
        assert left and float(deltas[d.param][left].abs().max()) == 0.0, (d.experts, left)


@pytest.mark.tiny
def test_added_by_hand_the_file_patches_the_model_as_documented(tmp_path) -> None:
    """No ctxc: each tensor added to its parameter as the metadata says, on a copy of the model,
    gives ctxc's patched logits (within float32's reload bound: other addresses, other
    rounding)."""
    model, result = _compiled("gemma3", seed=5)
    write_deltas(model, result.patch, tmp_path / DELTAS_FILE)
    user = copy.deepcopy(model)
    query = torch.tensor([result.patch.meta.query_ids])
    patched = patched_logits(model, result.patch, query)
    with torch.no_grad():
        for name, delta in load_file(str(tmp_path / DELTAS_FILE)).items():
            param = user.get_parameter(name)
            param.data = (param.float() + delta).to(param.dtype)  # APPLY, as the file says
        by_hand = user(input_ids=query).logits[0]
        plain = model(input_ids=query).logits[0]
    diff = float((by_hand - patched).abs().max())
    assert diff <= RELOAD_ATOL, f"by hand {diff:.3g} from ctxc's patched model"
    moved = float((plain - patched).abs().max())
    assert moved > 100 * RELOAD_ATOL, f"the patch moves the logits by {moved:.3g} only"


@pytest.mark.tiny
def test_a_wrong_file_fails_its_check(tmp_path) -> None:
    model, result = _compiled("gemma3", seed=6)
    path = tmp_path / DELTAS_FILE
    write_deltas(model, result.patch, path)
    full = result.full_logits
    deltas = load_file(str(path))
    name = next(n for n, t in deltas.items() if t.ndim == 2 and t.shape[0] != t.shape[1])
    save_file({**deltas, name: deltas[name] + 0.05}, str(path))  # one delta off
    with pytest.raises(CheckFailed) as info:
        check_deltas(model, result.patch, path, full)
    want = (
        "deltas.safetensors check failed: max |logit diff| of the model with its deltas added "
        "from ctxc's patched model "
    )
    assert str(info.value).startswith(want), str(info.value)
    save_file({**deltas, name: deltas[name].T.contiguous()}, str(path))  # another shape
    with pytest.raises(CtxcError, match=rf"^{name} of shape \(\d+, \d+\) fits shape \(\d+, \d+\)"):
        check_deltas(model, result.patch, path, full)


@pytest.mark.tiny
def test_a_forced_failure_leaves_nothing(tmp_path, monkeypatch) -> None:
    model, result = _compiled("gemma3", seed=7)
    monkeypatch.setenv("CTXC_TEST_FAIL_CHECK", KIND)
    with pytest.raises(ArtefactError, match=r"^deltas\.safetensors check failed: .*forced by"):
        emit_checked(model, result.patch, tmp_path, [KIND])
    assert list(tmp_path.iterdir()) == [], "a failed artefact leaves nothing"
