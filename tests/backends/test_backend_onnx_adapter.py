"""The onnxruntime adapter backend: one patchable session, one ``.onnx_adapter`` per context.

Tolerances: onnxruntime with an adapter against the torch patched model measures 2.9e-7 to
7.2e-7 on the tiny Gemma 3 here (the baked file's figure, BAKED_ATOL in test_backend_onnx.py);
the bounds are about ten times that.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np
import pytest

import ctxc
from ctxc.backends.onnx.check import ONNX_ATOL
from ctxc.backends.onnx.ort_adapter import (
    ADAPTER_FILE,
    PATCHABLE_FILE,
    emit_ort_adapter,
    load_adapter,
    run_adapter,
    write_adapter,
)
from ctxc.backends.onnx.thresholds import ONNX_FLOOR_FACTOR
from ctxc.core.thresholds import floor_bound
from testbed.tiny_models import build, shared
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import diff_msg, full_logits, max_diff, random_ids

if TYPE_CHECKING:
    import onnxruntime as ort

pytestmark = needs_extra("onnx")

# bound on max |onnxruntime with the adapter, query alone - torch full context|
FULL_CONTEXT_ATOL = 1e-5


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """A tiny Gemma 3 (post-norm scales), three contexts' patches, one adapter export.

    The model is the session's ``shared`` one (seed 0, as ``build``; built and traced once):
    the compiles and the exports here leave it as it was (tests/backends/test_backend_onnx.py
    checks that of every ONNX export)."""
    model = shared("gemma3")
    patches = [ctxc.compile(model, context_ids=random_ids(s, 9 + 5 * s)).patch for s in (1, 2, 3)]
    out = tmp_path_factory.mktemp("adapter")
    path, figures = emit_ort_adapter(model, patches[0], out)
    return model, patches, out, path, figures


@pytest.fixture(scope="module")
def lora_rule(gemma, tmp_path_factory):
    """The same model's ``lora``-rule patch (o_proj, gate, up and down factors, no norm
    vector) and its adapter export: a patchable graph with other inputs than ``gemma``'s."""
    model = gemma[0]
    patch = ctxc.compile(model, context_ids=random_ids(4, 18), update="lora").patch
    out = tmp_path_factory.mktemp("lora-adapter")
    path, figures = emit_ort_adapter(model, patch, out)
    return patch, out, path, figures


def _session(path) -> ort.InferenceSession:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.slow
def test_adapter_is_checked_and_matches_full_context(gemma) -> None:
    _, patches, out, path, figures = gemma
    assert path == out / ADAPTER_FILE and (out / f"{ADAPTER_FILE}.json").is_file()
    assert (out / PATCHABLE_FILE).is_file() and figures.onnx_file == PATCHABLE_FILE
    lengths = [c.length for c in figures.checks]  # the query, and the longest tail up to 16
    assert lengths == [1, len(patches[0].meta.context_ids) + 1]
    # The bound is the absolute one or a multiple of onnxruntime's own floor, measured in the
    # check on the unpatched model (the session without an adapter).
    floor = figures.runtime_floor
    assert floor is not None and 0.0 <= floor <= 1e-5, floor
    assert figures.tolerance == floor_bound(ONNX_ATOL, floor, ONNX_FLOOR_FACTOR) == ONNX_ATOL
    assert all(c.max_abs_diff <= 1e-5 and c.top1_match for c in figures.checks), figures.checks
    assert figures.fidelity.max_abs_logit_diff <= FULL_CONTEXT_ATOL, figures.fidelity
    record = json.loads((out / f"{ADAPTER_FILE}.json").read_text())
    assert record["onnx_identity"] == figures.onnx_identity
    assert record["fingerprint"] == patches[0].meta.fingerprint
    assert (
        record["parameters"]
        == figures.parameters
        == len(patches[0].deltas) * 2
        - sum(d.vector is not None for d in patches[0].deltas.values())
    )


@pytest.mark.slow
def test_one_session_switches_between_contexts(gemma, tmp_path) -> None:
    model, patches, out, _, _ = gemma
    session = _session(out / PATCHABLE_FILE)
    adapters = []
    for i, patch in enumerate(patches):
        path = tmp_path / f"{i}.onnx_adapter"
        write_adapter(patch, session, path)
        adapters.append(load_adapter(path, session))
    # Twice round, so a switch back is tested too: each run gives its own context's logits.
    for _ in range(2):
        for patch, adapter in zip(patches, adapters, strict=True):
            got = run_adapter(session, adapter, np.array([patch.meta.query_ids]))[0]
            full = full_logits(model, patch)
            assert max_diff(got, full) <= FULL_CONTEXT_ATOL, diff_msg(
                "adapter run vs its own full context", got, full
            )
    other = full_logits(model, patches[1])
    got = run_adapter(session, adapters[0], np.array([patches[0].meta.query_ids]))[0]
    assert max_diff(got, other) > 100 * FULL_CONTEXT_ATOL, "contexts indistinguishable"


@pytest.mark.slow
def test_adapter_for_another_model_or_graph_is_refused(gemma, lora_rule, tmp_path) -> None:
    _, _, out, path, _ = gemma
    session = _session(out / PATCHABLE_FILE)
    alien = ctxc.compile(build("gemma3", seed=1), context_ids=random_ids(4, 12)).patch
    with pytest.raises(ctxc.CtxcError, match="another model") as info:
        write_adapter(alien, session, tmp_path / "alien.onnx_adapter")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "alien.onnx_adapter").exists()

    # A patchable graph with other inputs: the lora rule's (o_proj factors, no norm vector).
    _, other_out, _, other = lora_rule
    record = json.loads(path.with_name(path.name + ".json").read_text())
    assert other.parameters != record["parameters"], other.parameters
    with pytest.raises(ctxc.CtxcError, match="another ONNX graph") as info:
        load_adapter(path, _session(other_out / PATCHABLE_FILE))
    assert "\n" not in str(info.value)
    # The record of another model beside a good adapter file is caught too.
    record = json.loads(path.with_name(path.name + ".json").read_text())
    fake = tmp_path / "fake.onnx_adapter"
    fake.write_bytes(path.read_bytes())
    fake.with_name(fake.name + ".json").write_text(
        json.dumps({**record, "fingerprint": alien.meta.fingerprint})
    )
    with pytest.raises(ctxc.CtxcError, match="another model"):
        load_adapter(fake, session)


@pytest.mark.slow
def test_a_lora_rule_adapter_touches_linear_weights_only(gemma, lora_rule) -> None:
    """The ``lora`` rule on Gemma 3's sandwich norms (MATH.md 10): o_proj, gate, up and down
    factors, no norm vector; onnxruntime with the adapter matches the full context."""
    model = gemma[0]
    patch, _, _, figures = lora_rule
    assert all(d.vector is None for d in patch.deltas.values())
    assert sum(p.endswith("o_proj.weight") for p in patch.deltas) == model.config.num_hidden_layers
    assert figures.parameters == 2 * len(patch.deltas), figures.parameters  # u and v each
    assert all(c.max_abs_diff <= 1e-5 and c.top1_match for c in figures.checks), figures.checks
    assert figures.fidelity.max_abs_logit_diff <= FULL_CONTEXT_ATOL, figures.fidelity


def test_a_baked_patch_is_held_to_a_share_of_its_effect_and_an_exact_one_is_not():
    """``check_bound``: the floor rule for an exact patch; for a baked one, also
    ``ONNX_PATCH_SHARE`` of max |patched - unpatched| (here 100 logits: 1e-2 > 1e-3)."""
    import torch

    from ctxc.backends.onnx.check import check_bound
    from ctxc.backends.onnx.thresholds import ONNX_PATCH_SHARE

    unpatched = [torch.zeros(3, 8), torch.zeros(5, 8)]
    expected = [torch.zeros(3, 8), torch.zeros(5, 8)]
    expected[1][4, 2] = -100.0  # the patch's effect: 100 logits at one position
    floor = 1e-5
    exact = check_bound(ONNX_ATOL, floor, expected, unpatched, baked=False)
    assert exact == floor_bound(ONNX_ATOL, floor, ONNX_FLOOR_FACTOR) == ONNX_ATOL
    baked = check_bound(ONNX_ATOL, floor, expected, unpatched, baked=True)
    assert baked == pytest.approx(ONNX_PATCH_SHARE * 100.0) and baked > ONNX_ATOL, baked
    # A small effect leaves the absolute bound (and a large floor its multiple).
    small = [torch.full((3, 8), 0.5), torch.full((5, 8), 0.5)]
    assert check_bound(ONNX_ATOL, floor, small, unpatched, baked=True) == ONNX_ATOL
    assert check_bound(ONNX_ATOL, 1.0, small, unpatched, baked=True) == ONNX_FLOOR_FACTOR


def test_a_patch_says_whether_it_is_baked():
    from dataclasses import replace

    from ctxc.patch import PatchMeta

    meta = PatchMeta({}, [1], [2], "lora", "float32", "0")
    assert not meta.baked
    assert replace(meta, update="bake-fit").baked and replace(meta, update="bake-additive").baked
