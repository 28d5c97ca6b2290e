"""``BlockMap.node_names``: the nodes a solver may stop at, walked once per block map."""

from __future__ import annotations

import dataclasses

import pytest

from ctxc.passes.locate.graph_view import GraphView
from ctxc.store.traced import traced_blocks
from testbed.tiny_models import shared

pytestmark = pytest.mark.tiny


@pytest.mark.parametrize("name", ["llama", "gemma3", "mixtral"])
def test_node_names_hold_every_node_the_solver_reads(name: str) -> None:
    traced, blocks = traced_blocks(shared(name))
    names = blocks.node_names
    assert blocks.node_names is names, "walked again on a second read"
    graph = set(GraphView.of(traced).by_name)
    for b in blocks.blocks:
        wanted = {b.mlp_in, b.residual_add, b.activation, b.control, b.outer.node}
        wanted |= {s.node for s in b.inner}
        assert wanted <= names, f"{b.path}: missing {sorted(wanted - names)}"
    assert (names & graph) >= {b.residual_add for b in blocks.blocks}
    # A copy of the map is walked on its own (the cache is the instance's, not the class's).
    other = dataclasses.replace(blocks, blocks=blocks.blocks[:1])
    assert other.node_names < names, f"{len(other.node_names)} names against {len(names)}"
