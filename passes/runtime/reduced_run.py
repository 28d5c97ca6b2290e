"""Transform of values, not of the graph: the reduced run, interpreted node by node.

:class:`ReducedRun` runs the exported graph on the query and stops where its driver asks
(:meth:`ReducedRun.advance_to`); between stops the driver reads values and changes the run:
a parameter takes another value, or a node's output gets a low-rank action added, and the nodes
already computed from it are computed again up to the stop. It knows nothing of blocks or patches.
It mutates only its own environment, never the graph or the model.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import fx

from ctxc.models.placement import LazyWeight, PlacingInterpreter, materialize
from ctxc.passes.locate.graph_view import GraphView
from ctxc.passes.runtime.compile_segments import compile_segments

__all__ = ["Action", "ReducedRun"]

Action = Callable[[torch.Tensor], torch.Tensor]  # a node's value -> the value it takes instead

_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


class ReducedRun(PlacingInterpreter):
    """Steps through the graph on given inputs; values are kept (the query is a few tokens).

    Args:
        view: the graph's :class:`GraphView`.
        keep: nodes whose values are copied when computed (and recomputed), because a later
            in-place op may change the stored value (Falcon adds the attention output into the
            MLP output with ``add_``); :meth:`value` returns the copy.
        inputs: the graph's inputs (:meth:`TracedModel.placeholder_values`).
        stops: names of the nodes the driver may stop at, read or add actions to (names of no
            node are ignored): the stretches between them run compiled (:mod:`compile_segments`)
            when these stops come a second time.
        ops: node -> ``fn(*args, **kwargs)`` that computes its value instead of its op (the
            caller computes it together with another run's: ``ctxc generate`` reads the LM
            head's weights once for both its runs); they are stops too.
    """

    def __init__(
        self,
        view: GraphView,
        keep: Iterable[fx.Node],
        inputs: Sequence[object],
        stops: Iterable = (),
        ops: Mapping[fx.Node, Callable] | None = None,
    ) -> None:
        ids = inputs[view.traced.input_index]
        assert isinstance(ids, torch.Tensor)  # the input ids, among weights and constants
        placer = view.traced.placer(ids)
        super().__init__(view.traced.graph_module, placer, garbage_collect_values=False)
        self.view = view
        self.keep = frozenset(keep)
        self.kept: dict[fx.Node, torch.Tensor] = {}
        # kept node -> the input values (and their versions) its op output came from, or None
        # when the kept copy has actions added (:meth:`_plain_kept`).
        self._sources: dict[fx.Node, tuple | None] = {}
        # node -> actions added to its value (apply="lowrank").
        self.actions: dict[fx.Node, list[Action]] = {}
        # offloaded parameter -> (its lazy original, how to patch it again): for release().
        self.rebakes: dict[fx.Node, tuple[LazyWeight, Callable]] = {}
        self.ops = dict(ops or {})
        self.args_iter = iter(self.graph.process_inputs(*inputs))
        named = (view.by_name[n] for n in stops if n in view.by_name)
        stops = frozenset((*named, *self.keep, *self.ops))
        # A dispersed model's ops run through its placer, node by node: no compiled stretches.
        plain = stops and placer is None
        self.segments = (compile_segments(view.traced.graph_module, stops) if plain else None) or {}
        self._pending = iter(self.graph.nodes)
        self._dependents: dict[tuple[fx.Node, fx.Node], list[fx.Node]] = {}
        self._last: fx.Node | None = None
        # param -> its value before replacing (None: not computed yet)
        self._replaced: dict[fx.Node, torch.Tensor | None] = {}
        self.result = None

    # -- stepping ----------------------------------------------------------------------------

    def advance_to(self, stop: fx.Node) -> torch.Tensor:
        """Compute the nodes up to ``stop`` (included), in graph order; ``stop``'s value.

        Raises:
            RuntimeError: ``stop`` was passed already (stops must come in graph order; the
                last node computed may be stopped at again).
        """
        if stop is self._last:
            return self.env[stop]
        if stop in self.env:
            raise RuntimeError(f"node {stop.name} was computed before the driver stopped there")
        for node in self._pending:
            self._step_from(node, stop)
            if node is stop or self._last is stop:
                return self.env[stop]
        raise RuntimeError(f"node {stop.name} is not in the graph")

    def finish(self):
        """Compute the remaining nodes; the graph's output."""
        for node in self._pending:
            self._step_from(node, None)
        return self.result

    def _step_from(self, node: fx.Node, stop: fx.Node | None) -> None:
        """Compute ``node``, or the compiled segment it starts when nothing in it is the stop
        or has an action (the segment's other nodes are then consumed from the pending ones)."""
        seg = self.segments.get(node)
        if seg is None or stop in seg.members or not seg.members.isdisjoint(self.actions):
            self._step(node)
            return
        env = self.env
        values = seg.run(*[env[n] for n in seg.inputs])
        for n in seg.guards:
            env[n] = None
        for n, v in zip(seg.computed, values, strict=True):
            env[n] = v
        for _ in range(len(seg.nodes) - 1):
            next(self._pending)
        self._last = seg.nodes[-1]

    def _step(self, node: fx.Node) -> None:
        self._last = node
        if node.target is _ASSERT_METADATA:
            self.env[node] = None  # an export-time guard of a weight's dtype; nothing to compute
            return
        # Interpreter.run_node without its error-context manager, inlined (:meth:`_compute`):
        # this loop runs at every generated token of `ctxc generate`, where per-node cost shows.
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        op = self.ops.get(node)
        value = op(*args, **kwargs) if op else getattr(self, node.op)(node.target, args, kwargs)
        acts = self.actions.get(node)
        if acts:
            for act in acts:
                value = act(value)
        if node in self.keep:
            self._keep(node, value, not acts)
        self.env[node] = value
        if node.op == "output":
            self.result = self.graph.process_outputs(self.env[node])

    def _compute(self, node: fx.Node):
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        op = self.ops.get(node)
        value = op(*args, **kwargs) if op else getattr(self, node.op)(node.target, args, kwargs)
        acts = self.actions.get(node, ())
        for act in acts:
            value = act(value)
        if node in self.keep:
            self._keep(node, value, not acts)
        return value

    def _keep(self, node: fx.Node, value: torch.Tensor, plain: bool) -> None:
        """Copy ``value``; when it is the op's own output (``plain``: no action), remember the
        inputs it came from, each with its version (:meth:`_plain_kept`)."""
        self.kept[node] = _copy(value)
        # Weak references: a strong one would keep each block's patched weight alive after
        # release() drops it (an offloaded compile held 5 MiB more per solved block).
        self._sources[node] = (
            tuple((_weak(v), ver) for v, ver in self._inputs_now(node)) if plain else None
        )

    def _inputs_now(self, node: fx.Node) -> tuple:
        values = (self.env[n] for n in node.all_input_nodes)
        return tuple((v, v._version if isinstance(v, torch.Tensor) else None) for v in values)

    def _plain_kept(self, node: fx.Node) -> torch.Tensor | None:
        """The kept copy of ``node``'s op output when the op would give it again: no action
        since, and the same input tensors, none changed in place (a tensor's version counts
        its in-place changes); else None."""
        then, kept = self._sources.get(node), self.kept.get(node)
        if then is None or kept is None or self.actions.get(node):
            return None
        now = self._inputs_now(node)
        same = len(now) == len(then) and all(
            a is b() and va == vb for (a, va), (b, vb) in zip(now, then, strict=True)
        )
        return kept if same else None

    # -- reading and changing ----------------------------------------------------------------

    def value(self, node: fx.Node) -> torch.Tensor:
        """``node``'s value as computed (its kept copy, when it has one)."""
        kept = self.kept.get(node)
        return kept if kept is not None else self.env[node]

    def param(self, node: fx.Node) -> torch.Tensor:
        """A parameter placeholder's value, read from its store when it is offloaded."""
        return materialize(self.env[node])

    def replace_param(
        self,
        param: fx.Node,
        value: torch.Tensor,
        upto: fx.Node,
        rebake: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Make ``param`` read ``value``, recomputing the nodes up to ``upto`` that used it.

        ``rebake(original) -> value``: for an offloaded parameter, how to compute ``value``
        again after :meth:`release` drops it.
        """
        old = self.env.get(param)
        if param in self.rebakes and rebake is not None:  # replaced again: the newest bake
            self.rebakes[param] = (self.rebakes[param][0], rebake)
        elif isinstance(old, LazyWeight) and rebake is not None:
            self.rebakes[param] = (old, rebake)
        elif not isinstance(old, LazyWeight):
            self._replaced.setdefault(param, old)
        self.env[param] = value
        self.recompute_from(param, upto)

    def original_param(self, param: fx.Node) -> torch.Tensor:
        """``param``'s value before any :meth:`replace_param` (read from its store when it is
        offloaded): what a patch replaced again is baked from."""
        if param in self.rebakes:
            return self.rebakes[param][0].get()
        first = self._replaced.get(param)
        return first if first is not None else self.param(param)

    def release(self) -> None:
        """Drop the patched values of offloaded parameters (a block's worth of weights): a
        later use reads the original from its store and patches it again. Keeps the run's
        memory at about one block, whatever the model's size."""
        self.restore_params()  # in-memory weights: the run reads them no more either
        for node, (lazy, rebake) in self.rebakes.items():
            if not isinstance(self.env.get(node), LazyWeight):

                def fetch(rows, lazy=lazy, rebake=rebake):
                    value = rebake(lazy.get())
                    return value if rows is None else value[rows[0] : rows[1]]

                self.env[node] = dataclasses.replace(lazy, fetch=fetch)

    def restore_params(self) -> None:
        """Give the replaced in-memory parameters their first values back, without recomputing.

        For a driver whose later steps no longer read them (the solver, once a block's nodes
        are all computed): a replaced value held to the end of the run would keep a copy of
        every patched weight of the model alive at once.
        """
        self.env.update(self._replaced)
        self._replaced.clear()

    def add_action(self, node: fx.Node, act: Action, upto: fx.Node) -> None:
        """Add ``act`` to ``node``'s value from now on; if it is computed, recompute after it."""
        raw = self._plain_kept(node) if node in self.env else None
        self.actions.setdefault(node, []).append(act)
        if node in self.env:
            if raw is not None:
                # Its op on the same inputs gives the kept copy again, bit for bit: add the action
                # to that (an outer linear's weights are not read a second time).
                value = act(raw)
                self._keep(node, value, False)
                self.env[node] = value
            else:  # afresh: a later in-place op may have changed the stored value
                self.env[node] = self._compute(node)
            self.recompute_from(node, upto)

    def recompute_from(self, root: fx.Node, upto: fx.Node) -> None:
        """Compute again, in graph order, every node up to ``upto`` that depends on ``root``."""
        done = {root}
        for d in self._dependents_of(root, upto):
            if d not in self.env:
                continue
            schema = getattr(d.target, "_schema", None)
            if schema is not None and schema.is_mutable and d.args[0] not in done:
                raise RuntimeError(
                    f"cannot recompute the in-place op {d.target} on a value the patch does "
                    "not change"
                )
            self.env[d] = self._compute(d)
            done.add(d)

    def _dependents_of(self, root: fx.Node, upto: fx.Node) -> list[fx.Node]:
        key = (root, upto)
        if key not in self._dependents:
            self._dependents[key] = self.view.descendants_upto(root, self.view.index[upto])
        return self._dependents[key]


def _weak(value) -> Callable[[], object]:
    """A call that gives ``value`` back: a weak reference for a tensor (None once it is freed,
    so a freed input never matches), the value itself otherwise."""
    if isinstance(value, torch.Tensor):
        return weakref.ref(value)
    return lambda: value


def _copy(value):
    """A detached copy of a tensor, or of each tensor of a tuple (a split's chunks)."""
    if isinstance(value, list | tuple):
        return type(value)(v.detach().clone() for v in value)
    return value.detach().clone()
