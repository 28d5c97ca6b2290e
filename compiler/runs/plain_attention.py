"""Attention as the plain runtime (Transformers, its defaults) computes it, from its config.

``torch.export`` builds every attention mask in the graph. Transformers' default (SDPA) path
skips the mask where it can (no padding, as many keys as queries) and passes the attention
module's own ``is_causal`` to the kernel instead. For a causal module both say the same thing.
For a module whose config asks for bidirectional attention (PaliGemma's Gemma text model:
``use_bidirectional_attention``, so ``is_causal = False``) they do not: the runtime fed the
query alone attends both ways, the graph causally, and a patch solved through the graph is off
in the runtime (a tiny PaliGemma, three query tokens: 1.62, top-1 wrong).

So the runtime is run, and the graph follows it:

- the control run is the model's own forward on the query (its default attention), recording
  the arguments of each ``scaled_dot_product_attention`` call (:func:`sdpa_calls`); the graph's
  run on the query records its own. In the usual case the two give the same logits, bit for
  bit, and nothing more is done.
- when an attention module of the text path declares ``is_causal = False``, or the two runs'
  masks differ, every attention call of the graph is given the runtime's own mask and flag:
  the reduced run's from the query run, the full run's from the model's own forward over
  context + query (:func:`graph_ops`). The graph so corrected must reproduce the runtime's
  logits on the query; else the compile stops with one line (:func:`plain_attention`).

A compile that verifies its patch in the runtime runs the graph on the query anyway: the
solver's reduced run is the graph with the patch's weights, and the verification is the
runtime with the same weights. There the comparison is made on those two runs
(:func:`check_runtime_gap`, with ``deferred``), and the graph's attention calls on the query
come from the few nodes that compute its masks (:func:`mask_calls`: 76 index and compare ops
of Gemma 3 270M's 2,451), not from a run of the whole graph: one query run fewer (0.08 s of a
1.2 s compile, docs/results/speed.md).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import fx
from torch.overrides import TorchFunctionMode

from ctxc.core.errors import CtxcError
from ctxc.frontend.trace import WRAPPED, TracedModel, no_cache
from ctxc.models.placement import PlacingInterpreter
from ctxc.passes.runtime.banded_attention import sdpa_call
from ctxc.passes.runtime.compile_segments import Segment, segment

__all__ = [
    "PlainAttention",
    "SdpaCall",
    "check_runtime_gap",
    "graph_ops",
    "mask_calls",
    "plain_attention",
    "sdpa_calls",
]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
# The largest gap between the graph's run on the query and the runtime's that is rounding (a
# kernel taking another path), per unit of the largest logit: attention that sees other keys
# moves logits by tenths and more.
_GAP = {torch.float32: 1e-5, torch.float64: 1e-9}
# Ops whose presence among a mask's inputs means the mask depends on the model's activations:
# then the graph's calls are read from a run of the whole graph.
_HEAVY = {
    _SDPA,
    torch.ops.aten.linear.default,
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.matmul.default,
}


@dataclass(frozen=True)
class SdpaCall:
    """What one attention call was given besides its queries, keys and values.

    Attributes:
        mask: the ``attn_mask`` (bool or additive), or None.
        is_causal: the ``is_causal`` flag.
    """

    mask: torch.Tensor | None
    is_causal: bool


@dataclass(frozen=True)
class PlainAttention:
    """The runtime's run on the query, and what the graph needs to compute the same.

    Attributes:
        control: the model's own forward on the query alone [k, vocab], float32.
        query_ops: graph node -> the runtime's attention call, for the reduced run; empty when
            the graph computes the runtime's attention already.
        follow: the full run must take the runtime's attention calls too.
        graph_vs_runtime: max |logit diff| between the graph's run on the query (so corrected)
            and the runtime's; None when deferred to the patched runs
            (:func:`check_runtime_gap`).
        bidirectional: the attention modules of the text path that declare ``is_causal =
            False`` (their paths).
    """

    control: torch.Tensor
    query_ops: dict[str, Callable]
    follow: bool
    graph_vs_runtime: float | None
    bidirectional: tuple[str, ...] = ()


class _Recorder(TorchFunctionMode):
    """Records the arguments of each ``F.scaled_dot_product_attention`` call while active."""

    def __init__(self) -> None:
        super().__init__()
        self.active = True
        self.calls: list[SdpaCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and func is torch.nn.functional.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            self.calls.append(SdpaCall(mask, bool(causal)))
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording(model: torch.nn.Module, within: str = "") -> Iterator[_Recorder]:
    """Record the attention calls ``model`` makes in the body, inside module ``within`` only
    (the language model of a vision-language model: not its vision tower's calls)."""
    rec = _Recorder()
    handles = []
    if within:
        module = model.get_submodule(within)
        rec.active = False
        handles.append(module.register_forward_pre_hook(lambda *_a: setattr(rec, "active", True)))
        handles.append(module.register_forward_hook(lambda *_a: setattr(rec, "active", False)))
    try:
        with rec:
            yield rec
    finally:
        for handle in handles:
            handle.remove()


def sdpa_calls(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """The model's own forward on ``input_ids`` [1, n] and its attention calls.

    Returns:
        (logits [n, vocab] float32, one :class:`SdpaCall` per call, in order).
    """
    with recording(model) as rec, no_cache(model), torch.no_grad():
        logits = model(input_ids=input_ids).logits[0].float()
    return logits, tuple(rec.calls)


def _sdpa_nodes(traced: TracedModel) -> list[torch.fx.Node]:
    return [n for n in traced.graph.nodes if n.target is _SDPA]


def graph_ops(traced: TracedModel, calls: tuple[SdpaCall, ...]) -> dict[str, Callable]:
    """Every attention node of ``traced`` computed with the runtime's mask and flag.

    Args:
        traced: the graph (the full run's or the reduced run's).
        calls: the runtime's calls on the same input, in order (:func:`sdpa_calls`).

    Returns:
        node name -> ``fn(*args, **kwargs)`` for ``ReducedRun`` / ``record_targets`` ``ops``.

    Raises:
        CtxcError: the runtime made another number of attention calls than the graph holds.
    """
    nodes = _sdpa_nodes(traced)
    if len(nodes) != len(calls):
        raise CtxcError(
            f"the model's forward makes {len(calls)} attention calls where its graph holds "
            f"{len(nodes)}: ctxc cannot give the graph the runtime's attention"
        )
    return {n.name: _as_runtime(c) for n, c in zip(nodes, calls, strict=True)}


def _as_runtime(call: SdpaCall) -> Callable:
    def fn(*args, **kwargs):
        c = sdpa_call(_SDPA, args, kwargs)
        assert c is not None
        q = c["query"]
        mask = None if call.mask is None else call.mask.to(q.device)
        extra = {"enable_gqa": c["enable_gqa"]} if "enable_gqa" in c else {}
        return _SDPA(
            q,
            c["key"],
            c["value"],
            attn_mask=mask,
            dropout_p=c["dropout_p"],
            is_causal=call.is_causal,
            scale=c["scale"],
            **extra,
        )

    return fn


class _GraphRun(PlacingInterpreter):
    """The graph on given inputs, recording its attention calls; ``ops`` replace nodes."""

    def __init__(self, traced: TracedModel, ids: torch.Tensor, ops: dict[str, Callable]) -> None:
        super().__init__(traced.graph_module, traced.placer(ids))
        self.ops, self.calls = ops, list[SdpaCall]()

    def run_node(self, n: torch.fx.Node):
        if n.target is _SDPA:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            c = sdpa_call(_SDPA, args, kwargs)
            assert c is not None
            self.calls.append(SdpaCall(c["attn_mask"], bool(c["is_causal"])))
            if n.name in self.ops:
                return self.ops[n.name](*args, **kwargs)
        return super().run_node(n)


def _graph_run(traced: TracedModel, ids: torch.Tensor, ops: dict) -> tuple[torch.Tensor, list]:
    run = _GraphRun(traced, ids, ops)
    with torch.no_grad():
        out = run.run(*traced.placeholder_values(ids))
    out = out[0] if isinstance(out, tuple | list) else out
    return out[0].float(), run.calls


def plain_attention(
    model: torch.nn.Module, traced: TracedModel, query: torch.Tensor, deferred: bool = False
) -> PlainAttention:
    """Run the model and its graph on the query; what the graph needs to compute the same.

    Args:
        model: the causal LM (or vision-language model), unpatched.
        traced: the reduced run's graph.
        query: int64 [1, k].
        deferred: the caller compares the graph's logits with the runtime's itself, on the
            patched model (:func:`check_runtime_gap`): the graph's attention calls are read
            from its mask nodes (:func:`mask_calls`) where they allow it, and the whole graph
            runs on the query only when they do not.

    Returns:
        the :class:`PlainAttention`.

    Raises:
        CtxcError: the graph, given the runtime's attention calls, still does not reproduce
            the runtime's logits on the query (one line with the figure).
    """
    control, calls = sdpa_calls(model, query)
    graph_calls = mask_calls(traced, query) if deferred else None
    graph = None
    if graph_calls is None:
        graph, graph_calls = _graph_run(traced, query, {})
    bidirectional = _bidirectional(model, traced)
    differs = len(calls) != len(graph_calls) or any(
        not _same_visibility(a, b, q_len=query.shape[1])
        for a, b in zip(calls, graph_calls, strict=False)
    )
    ops: dict[str, Callable] = {}
    if bidirectional or differs:
        ops = graph_ops(traced, calls)
        graph = None if deferred else _graph_run(traced, query, ops)[0]
    gap = None if graph is None else check_runtime_gap(graph, control, traced.dtype)
    return PlainAttention(control, ops, bool(ops), gap, bidirectional)


def check_runtime_gap(
    graph: torch.Tensor, runtime: torch.Tensor, dtype: torch.dtype, weights: str = ""
) -> float:
    """The max |logit diff| between the graph's run and the runtime's on the same input.

    Args:
        graph: the graph's logits [k, vocab].
        runtime: the model's own forward's [k, vocab].
        dtype: the model's dtype (the tolerance: rounding, a kernel taking another path).
        weights: what the two runs computed with, for the message (``""``: the model's own).

    Returns:
        the gap.

    Raises:
        CtxcError: the gap is more than rounding (one line with the figure).
    """
    diff = (graph - runtime.to(graph.device)).abs()
    gap = float(diff.max())
    tol = _GAP.get(dtype, 1e-2) * max(1.0, float(runtime.abs().max()))
    if not gap <= tol:
        raise CtxcError(
            f"the traced graph does not compute what the model's own forward computes on the "
            f"query{weights}: max |logit diff| {gap:.3g} (mean {float(diff.mean()):.3g}; at "
            f"most {tol:.2g}): no patch solved through it would hold where the model runs"
        )
    return gap


_MASKS: weakref.WeakKeyDictionary[fx.GraphModule, tuple | None] = weakref.WeakKeyDictionary()


def mask_calls(traced: TracedModel, ids: torch.Tensor) -> list[SdpaCall] | None:
    """The graph's attention calls on ``ids`` (each mask and flag), computed from the nodes
    the masks and flags depend on alone; None when one depends on the model's activations (a
    linear, a product or an attention call among its inputs) or the model is dispersed.

    Args:
        traced: the graph.
        ids: int64 [1, k].

    Returns:
        one :class:`SdpaCall` per attention node, in graph order, as :func:`_graph_run` records
        them; or None.
    """
    if traced.source is not None:
        return None
    gm = traced.graph_module
    if gm not in _MASKS:
        _MASKS[gm] = _mask_graph(traced)
    built = _MASKS[gm]
    if built is None:
        return None
    seg, slots = built
    places = traced.graph.find_nodes(op="placeholder")  # in graph order, as the values
    given = dict(zip(places, traced.placeholder_values(ids), strict=True))
    with torch.no_grad():
        env = dict(zip(seg.computed, seg.run(*[given[n] for n in seg.inputs]), strict=True))
    env.update(given)
    value = lambda arg: env[arg] if isinstance(arg, fx.Node) else arg  # noqa: E731
    return [SdpaCall(value(mask), bool(value(causal))) for mask, causal in slots]


def _mask_graph(traced: TracedModel) -> tuple[Segment, list[tuple]] | None:
    """The graph's nodes every attention node's mask and flag are computed from, as one
    :class:`Segment`, and per attention node its (mask, flag): a node or a constant; None when
    an activation is among their inputs."""
    slots = []
    for node in _sdpa_nodes(traced):
        call = sdpa_call(_SDPA, node.args, node.kwargs)
        assert call is not None
        slots.append((call["attn_mask"], call["is_causal"]))
    needed: set[fx.Node] = set()
    stack = [arg for pair in slots for arg in pair if isinstance(arg, fx.Node)]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        if n.target in _HEAVY:
            return None
        needed.add(n)
        stack.extend(n.all_input_nodes)
    nodes = [n for n in traced.graph.nodes if n in needed and n.op != "placeholder"]
    return segment(traced.graph_module, nodes), slots


def _bidirectional(model: torch.nn.Module, traced: TracedModel) -> tuple[str, ...]:
    """The attention modules (those of the graph's attention calls) declaring ``is_causal``
    False: Transformers' SDPA path then attends both ways wherever it skips the mask."""
    found = []
    for node in _sdpa_nodes(traced):
        stack = list(node.meta.get("nn_module_stack", {}).values())
        if not stack:
            continue
        path = str(stack[-1][0]).removeprefix(WRAPPED + ".")
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if getattr(module, "is_causal", True) is False:
            found.append(path)
    return tuple(dict.fromkeys(found))


def _same_visibility(a: SdpaCall, b: SdpaCall, q_len: int) -> bool:
    """Whether two attention calls let each query see the same keys."""
    va, vb = _visible(a, q_len), _visible(b, q_len)
    try:
        va, vb = torch.broadcast_tensors(va.cpu(), vb.cpu())
    except RuntimeError:
        return False
    return bool(torch.equal(va, vb))


def _visible(call: SdpaCall, q_len: int) -> torch.Tensor:
    """Bool [..., q, kv]: which keys each query sees (a call without a mask sees the query's
    own ``q_len`` keys: the runs compared have no cache)."""
    mask = call.mask
    if mask is None:
        every = torch.ones(q_len, q_len, dtype=torch.bool)
        return every.tril() if call.is_causal else every  # is_causal: top-left aligned
    seen = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    if call.is_causal:
        seen = seen & torch.ones(seen.shape[-2:], dtype=torch.bool, device=seen.device).tril()
    return seen
