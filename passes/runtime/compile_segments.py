"""Compile the stretches of a graph between the solver's stops into straight-line Python.

The reduced run interprets the graph node by node (``torch.fx.Interpreter``): each node costs
some microseconds of Python besides its op (fetching its arguments from the environment, the
dispatch through ``run_node``). ``ctxc generate`` runs the reduced pass at every token, on one
token, where that overhead is a large part of the step (issue 11). Between two nodes the solver
stops at, reads or changes, nothing needs node-by-node control: such a stretch runs as one
``fx.GraphModule`` that torch.fx generates, computing the same ops on the same values and
returning every node's value for the environment.

A graph's segments are compiled when the same stops are asked for a second time (a one-off
compile gains nothing from them) and kept per graph module. Analysis: nothing is mutated.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import fx

__all__ = ["Segment", "compile_segments", "compiled", "segment"]

_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
# Runs shorter than this are left to the interpreter: a GraphModule call costs about as much.
_MIN_NODES = 4
_SEEN: weakref.WeakKeyDictionary[fx.GraphModule, dict] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Segment:
    """A run of consecutive nodes, compiled.

    Attributes:
        nodes: the run's nodes, in graph order.
        members: the same, as a set.
        inputs: nodes outside the run whose values it reads.
        run: ``run(*input values) -> tuple`` of the values of ``computed``, in order.
        computed: the nodes whose values ``run`` returns.
        guards: the others: export-time dtype guards, which compute nothing (value None).
    """

    nodes: tuple[fx.Node, ...]
    members: frozenset[fx.Node]
    inputs: tuple[fx.Node, ...]
    run: Callable
    computed: tuple[fx.Node, ...]
    guards: tuple[fx.Node, ...]


def compile_segments(gm: fx.GraphModule, stops: Iterable[fx.Node]) -> dict[fx.Node, Segment] | None:
    """The segments of ``gm``'s graph between ``stops``, keyed by their first node.

    Args:
        gm: the lifted graph module.
        stops: nodes that must run one by one (the solver stops at, keeps, reads or acts on
            them); placeholders and the output always do.

    Returns:
        the segments, or None the first time these stops are asked for (nothing compiled).
    """
    key = frozenset(stops)
    seen = _SEEN.setdefault(gm, {})
    if key not in seen:
        seen[key] = None
        return None
    if seen[key] is None:
        seen[key] = _build(gm, key)
    return seen[key]


def compiled(gm: fx.GraphModule) -> list[dict[fx.Node, Segment]]:
    """The segment sets compiled so far for ``gm`` (what a run could use; for tests)."""
    return [segs for segs in _SEEN.get(gm, {}).values() if segs is not None]


def _build(gm: fx.GraphModule, stops: frozenset[fx.Node]) -> dict[fx.Node, Segment]:
    segments: dict[fx.Node, Segment] = {}
    run: list[fx.Node] = []
    for node in [*gm.graph.nodes, None]:
        plain = node is not None and node.op in ("call_function", "get_attr")
        plain = plain and not (node.target is _ASSERT_METADATA and node.users)
        if plain and node not in stops:
            run.append(node)
            continue
        if len(run) >= _MIN_NODES:
            segments[run[0]] = segment(gm, run)
        run = []
    return segments


def segment(gm: fx.GraphModule, nodes: list[fx.Node]) -> Segment:
    """Nodes of ``gm``'s graph (in graph order, none a placeholder) as one GraphModule that
    takes the values of the nodes they read from outside and returns every computed node's
    value (a stretch between stops; or any closed part of a graph, such as what its
    attention masks are computed from: ``compiler/runs/plain_attention.py``)."""
    members = frozenset(nodes)
    computed = [n for n in nodes if n.target is not _ASSERT_METADATA]
    inputs = list(dict.fromkeys(a for n in computed for a in n.all_input_nodes if a not in members))
    graph = fx.Graph()
    env = {n: graph.placeholder(f"in_{i}") for i, n in enumerate(inputs)}
    for node in computed:  # dtype guards are left out: the interpreter skips them too
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in computed))
    module = fx.GraphModule(gm, graph)
    guards = tuple(n for n in nodes if n.target is _ASSERT_METADATA)
    return Segment(tuple(nodes), members, tuple(inputs), module.forward, tuple(computed), guards)
