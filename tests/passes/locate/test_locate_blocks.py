"""The locator and classifier: the families of the core compiler, each kind of linear site,
and what the locator says when it finds no block."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D

import ctxc
from ctxc.frontend.trace import TracedModel, trace
from ctxc.passes.locate.block_map import LinearSite
from ctxc.passes.locate.classify import INPUT_CONTROLLABLE, OUTPUT_CONTROLLABLE, classify
from ctxc.passes.locate.graph_view import GraphView, op_name
from ctxc.passes.locate.locate_blocks import locate_blocks
from ctxc.passes.locate.match_linears import (
    LINEAR_MATCHERS,
    find_linear_sites,
    match_conv1d,
    match_expert_bank,
    match_linear,
    match_split_bank,
    match_transposed_matmul,
    routing_nodes,
)
from testbed.tiny_models import FAMILIES, build_any

pytestmark = pytest.mark.tiny  # every test traces a tiny model


@functools.cache
def _traced(family: str) -> tuple[torch.nn.Module, TracedModel]:
    """The seeded tiny model of ``family`` and its trace, once a module: the locator reads the
    graph and leaves it as it was (the golden test's second, fresh trace checks that its blocks
    are the same), so a test of another property re-traced the same graph for nothing."""
    model = build_any(family)
    return model, trace(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_layer_has_one_gated_block(family: str) -> None:
    model, traced = _traced(family)
    blocks = locate_blocks(traced)
    n = model.config.num_hidden_layers
    assert len(blocks.blocks) == n, [b.path for b in blocks.blocks]
    assert not blocks.rejections, blocks.rejections
    assert blocks.head is not None
    for i, b in enumerate(blocks.blocks):
        assert b.path == f"model.layers.{i}.mlp"
        assert {s.weight.rsplit(".", 2)[-2] for s in b.inner} == {"gate_proj", "up_proj"}
        assert b.outer.weight == f"model.layers.{i}.mlp.down_proj.weight"
        if family == "gemma3":
            assert b.output_control == "scale" and b.scale is not None
            assert b.scale.param == f"model.layers.{i}.post_feedforward_layernorm.weight"
            assert (b.scale.alpha, b.scale.offset) == (1.0, 1.0)  # Gemma scales by (1 + w)
        else:
            assert b.output_control == "linear" and b.scale is None


GOLDEN = Path(__file__).parents[2] / "golden"


@pytest.mark.parametrize("family", ["gemma3", "gpt2", "mixtral", "qwen2_moe", "falcon"])
def test_classify_roles_match_the_golden(family: str) -> None:
    """Every role, node by node: block, part, control, parameter, used by the stable rule.

    Keyed by fx node name (stable for a pinned torch); regenerate after an intended change
    with ``CTXC_UPDATE_GOLDEN=1`` and review the diff.
    """
    blocks = locate_blocks(_traced(family)[1])
    roles = classify(blocks)
    got = {node: [r.block, r.part, r.control, r.param, r.used] for node, r in sorted(roles.items())}
    path = GOLDEN / f"classify_{family}.json"
    if os.environ.get("CTXC_UPDATE_GOLDEN"):
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(path.read_text())
    changed = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    assert not changed, f"{len(changed)} roles differ from {path.name}: " + "; ".join(
        f"{k}: {want.get(k)} -> {got.get(k)}" for k in changed[:5]
    )
    controls = [r.control for r in roles.values()]
    assert controls.count(INPUT_CONTROLLABLE) > 0 and controls.count(OUTPUT_CONTROLLABLE) > 0
    assert locate_blocks(trace(build_any(family))) == blocks  # pure and deterministic


# -- one small traced module per kind of linear site --------------------------------------------


class _Lm(torch.nn.Module):
    """``input_ids -> logits`` around one layer, so ``trace`` exports it."""

    def __init__(self, layer: torch.nn.Module, width: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layer = layer
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.head(self.layer(self.embed(input_ids))))


class _FalconLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


class _Bank(torch.nn.Module):
    """Two experts, every row routed to expert ``token % 2``: ``bmm(W[ids], x[..., None])``."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2, width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        ids = (rows[:, 0] > 0).long()
        return torch.bmm(self.weight[ids], rows.unsqueeze(-1)).squeeze(-1).reshape(x.shape)


class _SplitBank(torch.nn.Module):
    """Two experts, JetMoE's way: rows sorted by expert, split by the counts, one linear per
    slice ``select(W, 0, e)``, summed back by ``index_add``. ``swap``: chunk i meets slice 1 - i."""

    def __init__(self, width: int = 8, swap: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2, width, width))
        self.swap = swap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        ids = (rows[:, 0] > 0).long()
        sizes = torch.zeros(rows.shape[0], 2).scatter(1, ids[:, None], 1).long().sum(0).tolist()
        order = ids.sort(0)[1]
        chunks = rows[order].split(sizes, dim=0)
        picks = (1, 0) if self.swap else (0, 1)
        out = torch.cat([F.linear(c, self.weight[e]) for c, e in zip(chunks, picks, strict=True)])
        return torch.zeros_like(rows).index_add(0, order, out).reshape(x.shape)


def _sites(layer: torch.nn.Module) -> list[tuple[LinearSite, GraphView]]:
    view = GraphView(trace(_Lm(layer)))
    return [(s, view) for s in find_linear_sites(view).values() if s.module == "layer"]


@pytest.mark.parametrize(
    ("layer", "matcher", "op", "layout", "bias"),
    [
        (torch.nn.Linear(8, 8), match_linear, "aten.linear", "out_in", "layer.bias"),
        (Conv1D(8, 8), match_conv1d, "aten.addmm", "in_out", "layer.bias"),
        (_FalconLinear(8, 8), match_transposed_matmul, "aten.matmul", "out_in", "layer.bias"),
        (_Bank(), match_expert_bank, "aten.bmm", "out_in", None),
    ],
    ids=["linear", "conv1d", "falcon", "expert_bank"],
)
def test_each_linear_matcher_finds_its_site(layer, matcher, op, layout, bias) -> None:
    ((site, view),) = _sites(layer)
    assert (site.weight, site.op, site.layout, site.bias) == ("layer.weight", op, layout, bias)
    assert bool(site.experts) == (matcher is match_expert_bank)
    product = next(n for n in view.nodes if op_name(n) == op)
    assert [m for m in LINEAR_MATCHERS if m(view, product) is not None] == [matcher]


def test_split_bank_is_one_site_with_its_routing() -> None:
    # One site for the bank (its per-slice linears are none of their own), at the cat.
    ((site, view),) = _sites(_SplitBank())
    cat = view.by_name[site.node]
    split, tokens = view.by_name[site.experts], view.by_name[site.tokens]
    assert (site.weight, site.op, site.layout, op_name(cat)) == (
        "layer.weight",
        "aten.linear",
        "out_in",
        "aten.cat",
    )
    gathered = view.by_name[site.input]  # the rows z[tokens], tokens the sort's indices
    assert op_name(split) == "aten.split_with_sizes" and split.args[0] is gathered
    assert op_name(gathered) == "aten.index.Tensor" and gathered.args[1] == [tokens]
    assert [m for m in LINEAR_MATCHERS if m(view, cat) is not None] == [match_split_bank]
    assert routing_nodes(view, site) == [*split.args[1], tokens]


def test_split_bank_pairing_chunks_with_other_slices_is_no_site() -> None:
    # Chunk i must meet slice i: the chunk lengths then say each row's expert.
    assert _sites(_SplitBank(swap=True)) == []


# -- where the search stops when there is no block ------------------------------------------------


class _Mixer(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_no_block_names_where_the_search_stopped_in_every_layer() -> None:
    model = _Lm(torch.nn.Sequential(_Mixer(), _Mixer()))  # attention only: no MLP anywhere
    blocks = locate_blocks(trace(model))
    assert not blocks.blocks
    where = [r.where for r in blocks.rejections]
    assert where == ["layer.0.out", "layer.0.qkv", "layer.1.out", "layer.1.qkv"], where
    reasons = {r.where: r.reason for r in blocks.rejections}
    assert reasons["layer.0.qkv"].endswith("reached the model input, no linear")
    assert "token mixer (aten.scaled_dot_product_attention in layer.0)" in reasons["layer.0.out"]
    message = r"no residual MLP block found in this model: layer\.0\.out: .*; layer\.1\.qkv: "
    with pytest.raises(ctxc.UnpatchableError, match=message):
        ctxc.compile(model, context_ids=[1, 2, 3, 4], query_ids=[5])


@pytest.mark.parametrize(
    ("family", "sandwich"),
    [("gemma2", True), ("gemma3", True), ("olmo2", True), ("llama", False), ("qwen3", False)],
)
def test_attention_projection_behind_a_post_norm_is_a_second_surface(family, sandwich) -> None:
    """MATH.md 10: ``v = x + s_a * norm(o_proj(a))`` feeds the block's MLP (Gemma 2/3, OLMo 2)."""
    model, traced = _traced(family)
    blocks = locate_blocks(traced)
    roles = classify(blocks)
    for b in blocks.blocks:
        layer = b.path.rsplit(".", 1)[0]
        if not sandwich:
            assert b.attention is None, b.attention
            continue
        att = b.attention
        assert att is not None, b.path
        assert att.site.module == f"{layer}.self_attn.o_proj", att.site.module
        assert att.norm.module == f"{layer}.post_attention_layernorm" and not att.norm.centered
        eps = model.config.rms_norm_eps
        assert att.norm.eps == pytest.approx(eps, rel=1e-6), (att.norm.eps, eps)
        assert b.param_shape(att.site.weight) == (64, 64)
        role = roles[att.site.node]
        assert role.part == "attention_output" and role.control == OUTPUT_CONTROLLABLE
        assert not role.used, "the stable rule does not move it"
