"""Tests of ``insert_deltas``: a patch baked into the exported graph computes the patched model.

Tiny random decoders are built from Transformers config classes (nothing is downloaded), with
their norm weights randomised so that every part of the graph matters: Llama (and in bfloat16),
GPT-2 (Conv1D, layout ``in_out``), Gemma 3 (post-norm scale vectors) and Mixtral (stacked expert
banks). The patches come from ``ctxc.compile`` (plus hand-made ones for the branches compile does
not produce here: both layouts on one model, vectors on a model without post norms, all-zero
factors).

The unlifted module from ``program.module()`` shares its weight tensors with the model, so
``patch.apply(model)`` would also change the graph module's base weights: every test runs the
graph module while the model is unpatched, and applies the patch only after.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import fx

import ctxc
from ctxc.core.errors import CtxcError
from ctxc.frontend.trace import TracedModel
from ctxc.passes.runtime.insert_deltas import DELTA_PREFIX, delta_attr_name, insert_deltas
from ctxc.patch import Delta, Patch
from ctxc.store.traced import traced_blocks
from testbed.tiny_models import build_any

pytestmark = pytest.mark.tiny

CONTEXT = list(range(3, 15))
FULL_CONTEXT_ATOL = 1e-5


# name -> (family, dtype, query ids). Gemma keeps a single-token query (the one-position scale
# move; k > 1 shares one scale: tests/passes/solver/test_multi_scale.py); bfloat16 checks
# .to(W.dtype) rounding.
ARCHS: dict[str, tuple[str, torch.dtype, list[int]]] = {
    "gemma3": ("gemma3", torch.float32, [20]),
    "gpt2": ("gpt2", torch.float32, [20, 21, 22]),
    "llama": ("llama", torch.float32, [20, 21, 22]),
    "llama-bf16": ("llama", torch.bfloat16, [20, 21, 22]),
    "mixtral": ("mixtral", torch.float32, [20, 21, 22]),
}


@dataclass(frozen=True)
class Case:
    model: torch.nn.Module
    traced: TracedModel
    patch: Patch
    query: torch.Tensor  # [1, k]
    full_logits: torch.Tensor  # [k, vocab] float32, unpatched model on context + query


@pytest.fixture(scope="module", params=sorted(ARCHS))
def case(request: pytest.FixtureRequest) -> Case:
    family, dtype, query_ids = ARCHS[request.param]
    model = build_any(family).to(dtype)  # seeded, random norm weights
    patch = ctxc.compile(model, context_ids=CONTEXT, query_ids=query_ids).patch
    traced, _ = traced_blocks(model)  # cached by compile: the same export
    query = torch.tensor([query_ids], dtype=torch.long)
    with torch.no_grad():
        full = model(input_ids=torch.tensor([CONTEXT + query_ids])).logits
    return Case(model, traced, patch, query, full[0, -len(query_ids) :].float())


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a.float() - b.float()).abs()
    return f"max |diff| {d.max().item():.3e}, mean |diff| {d.mean().item():.3e}"


def _run(gm: fx.GraphModule, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return gm(ids)


def _run_applied(model: torch.nn.Module, patch: Patch, ids: torch.Tensor) -> torch.Tensor:
    patch.apply(model, check=False)
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits
    finally:
        patch.remove(model)


def _factor_parts(delta: Delta) -> tuple[str, ...]:
    return ("vector",) if delta.vector is not None else ("u", "v")


def _attrs(delta: Delta) -> tuple[str, ...]:
    # An expert bank's delta also registers its expert indices (a buffer).
    return _factor_parts(delta) + (("experts",) if delta.experts else ())


def _expected_nodes(delta: Delta) -> int:
    # to(f32), add, to(dtype), plus the vector's get_attr; or the factors' two get_attrs, t, mm,
    # and one more t for the in_out layout; an expert bank adds the indices' get_attr, index and
    # index_put.
    if delta.vector is not None:
        return 4
    return 7 + (delta.layout == "in_out") + 3 * bool(delta.experts)


def _zero_patch(patch: Patch) -> Patch:
    deltas = {}
    for name, d in patch.deltas.items():
        if d.vector is not None:
            deltas[name] = Delta(name, d.block, vector=torch.zeros_like(d.vector))
        else:
            assert d.u is not None and d.v is not None
            zu, zv = torch.zeros_like(d.u), torch.zeros_like(d.v)
            deltas[name] = Delta(name, d.block, u=zu, v=zv, layout=d.layout, experts=d.experts)
    return Patch(deltas, patch.meta)


def _random_patch(model: torch.nn.Module, patch: Patch, rank: int = 2) -> Patch:
    """Random deltas on the patch's matrices, alternating layouts, and on every input norm.

    An expert bank keeps its layout and gets random factors on every expert but the first.
    """
    gen = torch.Generator().manual_seed(1)
    deltas: dict[str, Delta] = {}
    banks = [n for n, d in patch.deltas.items() if d.experts]
    for name in banks:
        size, out, inp = model.get_parameter(name).shape
        experts = tuple(range(1, size))
        u = torch.randn(len(experts), out, rank, generator=gen) * 0.05
        v = torch.randn(len(experts), inp, rank, generator=gen) * 0.05
        deltas[name] = Delta(name, "", u=u, v=v, experts=experts)
    matrices = [n for n, d in patch.deltas.items() if d.vector is None and not d.experts]
    for i, name in enumerate(matrices):
        out, inp = model.get_parameter(name).shape
        layout = "in_out" if i % 2 else "out_in"
        # For "in_out" the dense delta is (u @ v.T).T, so u spans the parameter's columns.
        rows, cols = (inp, out) if layout == "in_out" else (out, inp)
        u = torch.randn(rows, rank, generator=gen) * 0.05
        v = torch.randn(cols, rank, generator=gen) * 0.05
        deltas[name] = Delta(name, "", u=u, v=v, layout=layout)
    for name, p in model.named_parameters():
        if name.endswith("input_layernorm.weight"):
            deltas[name] = Delta(name, "", vector=torch.randn(p.shape, generator=gen) * 0.1)
    return Patch(deltas, patch.meta)


def test_counts(case: Case) -> None:
    gm = case.traced.program.module()
    params_before = dict(gm.named_parameters())
    nodes_before = len(gm.graph.nodes)
    get_attrs_before = sum(n.op == "get_attr" for n in gm.graph.nodes)

    result = insert_deltas(gm, case.patch)

    deltas = case.patch.deltas
    assert result.gm is gm
    assert result.inserted == tuple(deltas)
    assert len(result.inserted) == len(deltas) > 0
    assert result.replaced == len(deltas), "one original parameter replaced per delta"
    added_params = set(dict(gm.named_parameters())) - set(params_before)
    expected_params = {
        delta_attr_name(n, part) for n, d in deltas.items() for part in _factor_parts(d)
    }
    assert added_params == expected_params
    expected_attrs = {delta_attr_name(n, part) for n, d in deltas.items() for part in _attrs(d)}
    assert set(result.attrs_added) == expected_attrs
    assert all(name.startswith(DELTA_PREFIX) for name in expected_attrs)
    get_attrs_after = sum(n.op == "get_attr" for n in gm.graph.nodes)
    assert get_attrs_after - get_attrs_before == len(expected_attrs)
    assert result.nodes_added == sum(_expected_nodes(d) for d in deltas.values())
    assert len(gm.graph.nodes) - nodes_before == result.nodes_added
    # The base weights are the model's own tensors, untouched.
    for name, p in params_before.items():
        assert gm.get_parameter(name) is p
    # Each patched weight is now read only by the inserted cast to float32.
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target).removeprefix("model.") in deltas:
            assert [u.name.startswith(DELTA_PREFIX) for u in node.users] == [True], node.target


def test_zero_delta_is_exact(case: Case) -> None:
    plain = case.traced.program.module()
    gm = case.traced.program.module()
    insert_deltas(gm, _zero_patch(case.patch))
    for ids in (case.query, torch.tensor([CONTEXT + case.query[0].tolist()])):
        want, got = _run(plain, ids), _run(gm, ids)
        assert torch.equal(got, want), f"zero patch changed the outputs: {_diff(got, want)}"


def test_matches_applied_patch_and_full_context(case: Case) -> None:
    gm = case.traced.program.module()
    insert_deltas(gm, case.patch)
    got = _run(gm, case.query)  # before patch.apply: gm shares the model's weights
    want = _run_applied(case.model, case.patch, case.query)
    assert got.dtype == want.dtype
    assert torch.equal(got, want), f"graph vs patch.apply: {_diff(got, want)}"
    if case.traced.dtype == torch.float32:
        # bfloat16 logits are off by rounding, not by the patch: the tolerance holds in float32.
        err = (got[0].float() - case.full_logits).abs().max().item()
        assert err <= FULL_CONTEXT_ATOL, f"vs full context: {_diff(got[0], case.full_logits)}"


def test_random_deltas_both_layouts_match_applied_patch(case: Case) -> None:
    patch = _random_patch(case.model, case.patch)
    assert {d.layout for d in patch.deltas.values() if d.u is not None and not d.experts} == {
        "out_in",
        "in_out",
    }
    gm = case.traced.program.module()
    result = insert_deltas(gm, patch)
    assert result.nodes_added == sum(_expected_nodes(d) for d in patch.deltas.values())
    ids = torch.tensor([CONTEXT + case.query[0].tolist()])
    got = _run(gm, ids)
    want = _run_applied(case.model, patch, ids)
    assert torch.equal(got, want), f"graph vs patch.apply: {_diff(got, want)}"
    plain = _run(case.traced.program.module(), ids)
    assert not torch.equal(got, plain), "the random patch should change the outputs"


def test_deterministic(case: Case) -> None:
    first, second = case.traced.program.module(), case.traced.program.module()
    insert_deltas(first, case.patch)
    insert_deltas(second, case.patch)
    assert first.code == second.code
    a, b = _run(first, case.query), _run(second, case.query)
    assert torch.equal(a, b), f"two insertions differ: {_diff(a, b)}"


def test_errors_leave_module_unchanged(case: Case) -> None:
    gm = case.traced.program.module()
    code = gm.code
    name, delta = next(iter(case.patch.deltas.items()))
    unknown = Patch(
        {"no.such.weight": Delta("no.such.weight", "", vector=torch.zeros(3))}, case.patch.meta
    )
    with pytest.raises(CtxcError, match="not read by this graph"):
        insert_deltas(gm, unknown)
    wrong = Patch({name: Delta(name, delta.block, vector=torch.zeros(1))}, case.patch.meta)
    with pytest.raises(CtxcError, match="shape"):
        insert_deltas(gm, wrong)
    for bank, d in case.patch.deltas.items():
        if d.experts:  # an expert outside the bank
            outside = Delta(bank, d.block, u=d.u, v=d.v, experts=(99,) * len(d.experts))
            with pytest.raises(CtxcError, match="do not fit"):
                insert_deltas(gm, Patch({bank: outside}, case.patch.meta))
    assert gm.code == code
    assert not [n for n, _ in gm.named_parameters() if n.startswith(DELTA_PREFIX)]
    insert_deltas(gm, case.patch)
    with pytest.raises(CtxcError, match="already"):
        insert_deltas(gm, case.patch)


def test_custom_param_map(case: Case) -> None:
    # A dict keyed by get_attr target gives the same graph as the default mapping.
    table = {f"model.{name}": name for name in case.patch.deltas}
    by_table, by_default = case.traced.program.module(), case.traced.program.module()
    insert_deltas(by_table, case.patch, table)
    insert_deltas(by_default, case.patch)
    assert by_table.code == by_default.code
