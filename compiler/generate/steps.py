"""The paper's per-token protocol (MATH.md 6): recompile the patch at every generated token.

Greedy generation with the full context is the baseline. At every step the patch is recompiled
for the current history, the patched model sees only the current token, and the history follows
the baseline's token (teacher forcing). The baseline side keeps its KV cache from step to step,
and its cached decode step of the current token records the solver's targets with module hooks,
so a step costs one cached decode step plus one reduced pass, not a new prefill.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from ctxc.core.errors import CtxcError, OptionError
from ctxc.core.metrics import fidelity
from ctxc.core.options import GenerateOptions
from ctxc.core.vocabulary import DEFAULT_RULE
from ctxc.frontend.trace import TracedModel
from ctxc.generate.shared_head import head_split
from ctxc.models.kv_cache import cache_arg, cache_of
from ctxc.models.offload import input_device
from ctxc.passes.locate.block_map import BlockMap
from ctxc.passes.locate.graph_view import GraphView
from ctxc.passes.runtime.run_graph import BlockTargets, FullRun, record_targets
from ctxc.passes.solver.output_magnitude import AbsWeights
from ctxc.passes.solver.solve import Solution, solve
from ctxc.store.traced import traced_blocks

__all__ = ["GenerateResult", "GenerateStep", "generate"]

_ABS_MEMO_BYTES = 1 << 30  # the most memory the outer linears' |W| may keep between steps


@dataclass(frozen=True)
class GenerateStep:
    """One generated token: baseline and patched predictions and their agreement."""

    step: int
    baseline_token: int
    patched_token: int
    match: bool
    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    total_variation: float
    max_scale_change: float | None
    seconds: float


@dataclass(frozen=True)
class GenerateResult:
    """Per-step records and their summary."""

    steps: tuple[GenerateStep, ...]
    context_ids: list[int]
    update: str
    dtype: str
    apply: str
    targets_from: str
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def match_rate(self) -> float:
        return sum(s.match for s in self.steps) / max(1, len(self.steps))

    def to_dict(self) -> dict:
        diffs = [s.max_abs_logit_diff for s in self.steps]
        return {
            "context_ids": self.context_ids,
            "update": self.update,
            "dtype": self.dtype,
            "apply": self.apply,
            "targets_from": self.targets_from,
            "summary": {
                "steps": len(self.steps),
                "top1_match_rate": self.match_rate,
                "max_abs_logit_diff": max(diffs, default=0.0),
                # Every step compares one vocabulary row: the mean of the step means is the
                # mean over all compared logits. The mean of the step maxima is named as such.
                "mean_abs_logit_diff": sum(s.mean_abs_logit_diff for s in self.steps)
                / max(1, len(self.steps)),
                "mean_step_max_abs_logit_diff": sum(diffs) / max(1, len(diffs)),
                "max_total_variation": max((s.total_variation for s in self.steps), default=0.0),
            },
            "timings": self.timings,
            "steps": [asdict(s) for s in self.steps],
        }


class _TargetHooks:
    """Module hooks that record each block's ``z`` and ``y`` at the last position of a call.

    They stand in for the graph's full run when they are shown, on a probe input, to give
    exactly the graph's values (the MLP module is called with ``z``, and the residual add is
    the output of the module that holds it); otherwise :func:`generate` re-runs the graph.
    """

    def __init__(self, model: torch.nn.Module, traced: TracedModel, blocks: BlockMap) -> None:
        view = GraphView(traced)
        self.blocks = blocks
        self.values: dict[tuple[str, str], torch.Tensor] = {}
        self.inner: dict[str, dict[str, torch.Tensor]] = {}  # block -> inner linear -> W z_C
        self.inner_handles: dict[tuple[str, str], torch.utils.hooks.RemovableHandle] = {}
        # While a decode step runs on another thread: each block's targets as soon as its
        # output is recorded, for a solver that waits on ``changed`` (:meth:`waiter`).
        self.live: dict[str, BlockTargets] | None = None
        self.changed = threading.Condition()
        self.handles = []
        for b in blocks.blocks:
            z_mod = model.get_submodule(b.path)
            y_path = view.module_path(view.by_name[b.residual_add])
            y_mod = model.get_submodule(y_path) if y_path else model
            self.handles.append(
                z_mod.register_forward_pre_hook(self._pre(b.path, "z"), with_kwargs=True)
            )
            if b.attention is not None:  # v: what the pre-FFN norm reads (OLMo 2: z itself)
                v_mod = model.get_submodule(b.pre_norm) if b.pre_norm else z_mod
                self.handles.append(
                    v_mod.register_forward_pre_hook(self._pre(b.path, "v"), with_kwargs=True)
                )
            self.handles.append(y_mod.register_forward_hook(self._post(b.path)))
            # Each inner linear's output W z_C: the solver's input moves read it instead of
            # multiplying the weight again (solve's ``inner_outputs``).
            for site in b.inner if b.experts is None else ():
                if not site.experts:
                    module = model.get_submodule(site.module)
                    hook = module.register_forward_hook(self._out(b.path, site.module))
                    self.inner_handles[(b.path, site.module)] = hook

    def _pre(self, path: str, what: str) -> Callable:
        def hook(module, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            self.values[(path, what)] = x[0, -1:].detach().clone()  # [1, d]

        return hook

    def _out(self, path: str, module: str) -> Callable:
        def hook(mod, args, output):
            if isinstance(output, torch.Tensor):  # else not the site's value: never agrees
                self.inner.setdefault(path, {})[module] = output[0, -1:].detach().clone()

        return hook

    def keep_inner(self, graph: dict[str, BlockTargets]) -> None:
        """Keep the inner linears' hooks whose records on the probe are the graph's values, bit
        for bit (``graph``: :func:`record_targets` with ``inner``); remove the others: their
        blocks' input moves multiply the weights (solve's ``inner_outputs``)."""
        for (path, module), handle in list(self.inner_handles.items()):
            want = (graph[path].inner or {}).get(module)
            got = self.inner.get(path, {}).get(module)
            if want is None or got is None or not torch.equal(want, got):
                handle.remove()
                del self.inner_handles[(path, module)]
                self.inner.get(path, {}).pop(module, None)

    def _block_targets(self, path: str) -> BlockTargets:
        z, y, v = (self.values.get((path, w)) for w in ("z", "y", "v"))
        assert z is not None and y is not None
        inner = self.inner.get(path)
        return BlockTargets(z=z, y=y, v=v, inner=dict(inner) if inner else None)

    def _post(self, path: str) -> Callable:
        def hook(module, args, output):
            y = output[0] if isinstance(output, tuple | list) else output
            self.values[(path, "y")] = y[0, -1:].detach().clone()  # [1, d]
            if self.live is not None:
                with self.changed:
                    self.live[path] = self._block_targets(path)
                    self.changed.notify_all()

        return hook

    def waiter(self, decode: Future) -> Callable[[str], None]:
        """``wait(path)``: returns once the running ``decode`` recorded that block's targets in
        :attr:`live`; raises the decode's error if it failed first."""
        decode.add_done_callback(lambda _: self._notify())

        def wait(path: str) -> None:
            with self.changed:
                while self.live is not None and path not in self.live:
                    if decode.done():
                        decode.result()  # its error, if any
                        raise CtxcError(f"the decode step recorded no targets for {path}")
                    self.changed.wait(0.1)

        return wait

    def _notify(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def targets(self) -> dict[str, BlockTargets]:
        return {b.path: self._block_targets(b.path) for b in self.blocks.blocks}

    def close(self) -> None:
        for h in [*self.handles, *self.inner_handles.values()]:
            h.remove()


def _hooks_agree(model, traced, blocks, hooks: _TargetHooks, probe: torch.Tensor) -> bool:
    """Do the hooks see exactly the graph's targets on ``probe`` (no cache)?"""
    with torch.no_grad():
        model(input_ids=probe, use_cache=False)
    graph = record_targets(traced, blocks, probe, 1, inner=True).targets
    hooks.keep_inner(graph)
    seen = hooks.targets()
    return all(_same(graph[p], seen[p]) for p in graph)


def _same(a: BlockTargets, b: BlockTargets) -> bool:
    """The same targets, bit for bit (``v`` where the graph records it)."""
    same_v = a.v is None or (b.v is not None and torch.equal(a.v, b.v))
    return torch.equal(a.z, b.z) and torch.equal(a.y, b.y) and same_v


def _prefill(model: torch.nn.Module, inputs: dict, cached: bool, text: bool):
    """The baseline's KV cache over the context but its last token (None without hooks)."""
    if not cached:
        if not text:
            raise CtxcError(
                "an image context needs the cached decode path, and this model's module hooks "
                "do not see its graph's values"
            )
        return None
    with torch.no_grad():
        return cache_of(model(**inputs, use_cache=True))


def _record(step: int, solution: Solution, full: FullRun, start: float) -> GenerateStep:
    """One step's figures: the patched logits against the baseline's; seconds since ``start``."""
    fid = fidelity(solution.logits, full.logits)
    changes = [b.max_scale_change for b in solution.stats if b.max_scale_change is not None]
    return GenerateStep(
        step=step,
        baseline_token=fid.top1_full,
        patched_token=fid.top1,
        match=fid.top1_match,
        max_abs_logit_diff=fid.max_abs_logit_diff,
        mean_abs_logit_diff=fid.mean_abs_logit_diff,
        total_variation=fid.total_variation,
        max_scale_change=max(changes) if changes else None,
        seconds=time.perf_counter() - start,
    )


class _Stepper:
    """One protocol step at a time: the baseline's step (its cached decode, or a graph full
    run), then the reduced pass that compiles and applies the patch for the current token."""

    def __init__(self, model, traced, blocks, hooks, update: str, apply: str, device) -> None:
        self.model, self.traced, self.blocks, self.hooks = model, traced, blocks, hooks
        self.update, self.apply = update, apply
        self.cache_arg = cache_arg(model)
        self.cached = False
        self.cache = None
        self.head_op: Callable | None = None
        # The outer linears' |W|, formed at the first step and read at every later one, as
        # far as _ABS_MEMO_BYTES goes (a 7B model's down projections are 5.6 GB).
        self.abs_memo = AbsWeights(_ABS_MEMO_BYTES)
        # With two or more torch threads on a CPU, the decode step runs on a worker thread
        # while the solver works on the blocks it has recorded (each step computes the same
        # ops on the same values, in the same threads' settings: only their order in time
        # changes), and the reduced run's LM head then runs on both threads (``shared_head``).
        self.worker: ThreadPoolExecutor | None = None
        if torch.get_num_threads() >= 2 and torch.device(device).type == "cpu":
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="ctxc-decode")

    def start(self, ids: torch.Tensor, prefill: dict | None) -> dict[str, float]:
        """Probe the hooks and the split head, then prefill; the timings."""
        t0 = time.perf_counter()
        probe = ids[:, : min(8, ids.shape[1])]
        self.cached = _hooks_agree(self.model, self.traced, self.blocks, self.hooks, probe)
        if self.cached:
            self.head_op = head_split(self.traced, self.blocks, self.worker)
        probed = time.perf_counter() - t0
        t0 = time.perf_counter()
        text = prefill is None
        self.cache = _prefill(self.model, prefill or {"input_ids": ids[:, :-1]}, self.cached, text)
        return {"probe": probed, "prefill": time.perf_counter() - t0}

    def step(self, history: list[int], device) -> tuple[Solution, FullRun]:
        """The patched and the baseline's runs for the last token of ``history``."""
        current = torch.tensor([[history[-1]]], dtype=torch.long, device=device)
        if not self.cached:  # the hooks cannot stand in for the graph: a full run per step
            full_ids = torch.tensor([history], dtype=torch.long, device=device)
            full = record_targets(self.traced, self.blocks, full_ids, 1)
            return self._solve(current, full.targets, None), full
        if self.worker is None:
            out = self._decode(current)
            targets = self.hooks.targets()
            solution = self._solve(current, targets, None)
        else:  # the decode on the worker, the solver here as its blocks' targets arrive
            targets = self.hooks.live = {}
            decode = self.worker.submit(self._decode, current)
            try:
                solution = self._solve(current, targets, decode)
            finally:
                futures.wait([decode])  # never leave it running, whatever happened here
                self.hooks.live = None
            out = decode.result()
        self.cache = cache_of(out)
        return solution, FullRun(targets=targets, logits=out.logits[0, -1:].float())

    def _decode(self, current: torch.Tensor):
        with torch.no_grad():  # grad mode is per thread
            return self.model(input_ids=current, **{self.cache_arg: self.cache}, use_cache=True)

    def _solve(self, current: torch.Tensor, targets: dict, decode: Future | None) -> Solution:
        """The reduced pass on ``current``; with ``decode`` running, waiting for its targets."""
        ops = wait = None
        if decode is not None:
            wait = self.hooks.waiter(decode)
            if self.head_op is not None and self.blocks.head:  # on both threads, once free
                ops = {self.blocks.head: self.head_op(decode.result)}
        # The solver reads the targets only: the baseline's logits are read after it.
        pending = FullRun(targets=targets, logits=torch.empty(0, 0))
        args = (self.traced, self.blocks, pending, current, self.update)
        return solve(
            *args, apply=self.apply, ops=ops, wait=wait, abs_memo=self.abs_memo,
            inner_outputs=self.cached,
        )  # fmt: skip

    def close(self) -> None:
        self.hooks.close()
        if self.worker is not None:
            self.worker.shutdown()


def _options(
    options: GenerateOptions | None, max_new_tokens: int | None, update: str, apply: str | None
) -> GenerateOptions:
    """``options``, or :func:`generate`'s keyword arguments made into one (validated, once)."""
    if options is None:
        if max_new_tokens is None:
            raise OptionError("give {max_new_tokens} (or options)")
        return GenerateOptions(max_new_tokens, update, apply or "lowrank")
    if (max_new_tokens, update, apply) != (None, DEFAULT_RULE, None):
        raise CtxcError("give options or max_new_tokens/update/apply, not both")
    return options


def generate(
    model: torch.nn.Module,
    context_ids: list[int],
    max_new_tokens: int | None = None,
    update: str = DEFAULT_RULE,
    apply: str | None = None,
    on_step: Callable[[GenerateStep], None] | None = None,
    prefill: dict | None = None,
    *,
    options: GenerateOptions | None = None,
) -> GenerateResult:
    """Run the per-token protocol for ``max_new_tokens`` steps.

    Args:
        model: a causal LM; left unmodified.
        context_ids: the context, at least 2 tokens (the last one is the first query).
        max_new_tokens: steps to run (at least 1).
        update: the update rule.
        apply: ``lowrank`` (default) or ``baked``.
        on_step: called with each step's record.
        prefill: the baseline's prefill inputs over ``context_ids[:-1]`` when they are more than
            ids (an image context: ``ctxc.models.images.prefill_inputs``); the steps are text.
        options: a :class:`~ctxc.core.options.GenerateOptions` (validated) instead of
            ``max_new_tokens``, ``update`` and ``apply``.

    Returns:
        the :class:`GenerateResult`.

    Raises:
        OptionError: a bad ``max_new_tokens``, ``update`` or ``apply`` (named).
    """
    options = _options(options, max_new_tokens, update, apply)
    max_new_tokens, update, apply = options.max_new_tokens, options.update, options.apply
    if len(context_ids) < 2:
        raise CtxcError("the context needs at least two tokens")
    traced, blocks = traced_blocks(model)
    if blocks.rejections:
        raise CtxcError("; ".join(str(r) for r in blocks.rejections))
    dtype = traced.dtype
    # lowrank by default (GenerateOptions): the protocol measures the patched model in memory,
    # and actions beside the weights cost far less than materialising every patched matrix at
    # every token (MATH.md 6).
    device = input_device(model)  # the embedding's device, dispersed or not
    ids = torch.tensor([context_ids], dtype=torch.long, device=device)
    hooks = _TargetHooks(model, traced, blocks)
    stepper = _Stepper(model, traced, blocks, hooks, update, apply, device)
    steps: list[GenerateStep] = []
    # A full collection rescans every object the process holds (the model, its graph: half a
    # million), 0.2-0.5 s that fell in one step of ten; frozen, they are left out of it while
    # the steps run (unless the caller froze objects of its own: then leave its setting).
    freeze = gc.get_freeze_count() == 0
    try:
        timings = stepper.start(ids, prefill)
        if freeze:
            gc.freeze()
        history = list(context_ids)
        for step in range(max_new_tokens):
            start = time.perf_counter()
            solution, full = stepper.step(history, device)
            record = _record(step, solution, full, start)
            steps.append(record)
            if on_step is not None:
                on_step(record)
            history.append(record.baseline_token)  # teacher forcing: follow the baseline
    finally:
        if freeze:
            gc.unfreeze()
        stepper.close()
    timings["steps"] = sum(s.seconds for s in steps)
    return GenerateResult(
        steps=tuple(steps),
        context_ids=list(context_ids),
        update=update,
        dtype=str(dtype).removeprefix("torch."),
        apply=apply,
        targets_from=(
            "cached decode (module hooks)" if stepper.cached else "graph full run per step"
        ),
        timings={k: round(v, 4) for k, v in timings.items()},
    )
