"""The export ladder: dynamic, bounded, then static (or value-specialised) exports per length.

``torch.export`` with a dynamic sequence length fails on models whose forward pass guards on the
length (a sliding window compared with it, a chunk size, a cache sized from the config). The
ladder tries, in order:

1. ``dynamic``: ``seq`` from 1 to the config's maximum position (``trace.longest_input``).
2. ``bounded``: the ranges ``torch.export`` suggests in its error (``Dim('seq', min=.., max=..)``;
   each failed try may suggest a narrower one), then ``[1, max - 1]``, ``[2, max]`` and
   ``[2, max - 1]`` (guards that hold below the configured maximum, or from 2 tokens on).
3. ``static``: one export per input length, made on demand (:func:`Frontend.traced_for`): the
   full run and the reduced run each get their own graph, and the block maps correspond by
   block path (the pipeline checks it).

4. ``specialised``: where the forward pass branches on tensor values (a data-dependent guard:
   an index list from ``nonzero``, a loop over the experts a routing hits), one static export per
   length with real-tensor propagation: each such branch is decided by the example input's
   values and checked by a runtime assertion left in the graph. Values that the length alone
   fixes (a causal mask's ``nonzero``) hold for every input of that length; values that depend
   on the ids (which experts fire) make the graph stop on another input. A dynamic export that
   stops at such a branch skips rungs 2 and 3 (no range or static length removes it).

A length that a bounded export does not cover (typically a one-token query under ``min=2``)
gets a static export too. :func:`build_frontend` fails only when every rung fails, with each
rung's reason.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from ctxc.core.errors import CtxcError, UntraceableError
from ctxc.frontend.trace import TracedModel, longest_input, trace

__all__ = ["Frontend", "build_frontend", "suggested_range"]

# Bounded tries at most: each failure may suggest a narrower range.
_MAX_TRIES = 4
# Static exports kept per model (one per input length seen).
_MAX_STATIC = 8
_SUGGESTED = re.compile(r"Dim\('seq'((?:,\s*(?:min|max)=\d+)*)\)")
_BOUND = re.compile(r"(min|max)=(\d+)")
_FIXED = re.compile(r"\bseq = \d+")
_SHAPES_LOG = "torch.fx.experimental.symbolic_shapes"
_DATA_DEPENDENT = re.compile(r"Could not guard on data-dependent expression (.+?) \(unhinted")
_CALL = re.compile(
    r'The following call raised this error:\s*File "([^"]+)", line (\d+), in \w+\s*\n(.*)'
)


# The block map the locator makes of each export (passes/locate's BlockMap, a layer above).
BlocksT = TypeVar("BlocksT")


@dataclass(frozen=True)
class Frontend(Generic[BlocksT]):
    """A model's exports: the shared one (dynamic or bounded), else static ones per length.

    Attributes:
        shared: the export that covers many lengths, or None when only static ones work.
        reasons: ``"rung: reason"`` for every rung tried before the one that worked.
        static: length -> static export, filled on demand (a cache: the one mutable part).
        locate: the block locator applied to each export.
        branch: the data-dependent branch the dynamic export stopped at ("" if none): static
            exports would stop there too, so each length goes to the specialised rung at once.
    """

    shared: tuple[TracedModel, BlocksT] | None
    reasons: tuple[str, ...]
    model_ref: Callable[[], torch.nn.Module | None]
    locate: Callable[[TracedModel], BlocksT]
    static: dict[int, tuple[TracedModel, BlocksT]] = field(default_factory=dict)
    branch: str = ""

    def traced_for(self, length: int | None = None) -> tuple[TracedModel, BlocksT]:
        """The export (and its block map) that holds for inputs of ``length`` tokens.

        Args:
            length: the input length; None: the shared export, or a static one at 8 tokens.

        Raises:
            CtxcError: a static export for ``length`` failed too (every rung's reason).
        """
        if self.shared is not None and (length is None or self.shared[0].accepts(length)):
            return self.shared
        length = length or 8
        if length not in self.static:
            model = self.model_ref()
            if model is None:
                raise CtxcError("the model of this frontend is gone")
            traced = _static(model, length, self.reasons, self.branch)
            if len(self.static) >= _MAX_STATIC:
                self.static.pop(next(iter(self.static)))
            self.static[length] = (traced, self.locate(traced))
        return self.static[length]


def _static(
    model: torch.nn.Module, length: int, reasons: tuple[str, ...], branch: str = ""
) -> TracedModel:
    """The static export for ``length`` tokens; else the value-specialised one (rung 4).

    Args:
        branch: the data-dependent branch an earlier rung met; then the static try is skipped.

    Raises:
        UntraceableError: the specialised export failed too (the branch leads the reasons).
        CtxcError: a static export failed for another reason than a data-dependent branch.
    """
    tried: tuple[str, ...] = ()
    if not branch:
        try:
            return trace(model, length, (length, length), "static")
        except CtxcError as exc:
            if not _DATA_DEPENDENT.search(_text(exc)):
                raise CtxcError(_every_rung(reasons, f"static ({length} tokens): {exc}")) from exc
            branch, tried = _branch(exc), (f"static ({length} tokens): {_short(exc)}",)
    try:
        # Real-tensor propagation decides each data-dependent branch by the example's values and
        # leaves a runtime assertion on it in the graph (torch/fx/experimental/symbolic_shapes.py,
        # "propagate_real_tensors"): a run whose values take another branch stops, never silently
        # follows the example's. Values fixed by the length alone (a mask) always pass.
        with (
            torch._functorch.config.patch(
                fake_tensor_propagate_real_tensors=True,
                generate_fake_kernels_from_real_mismatches=True,
            ),
            _quiet(_SHAPES_LOG),  # it warns once per decided branch: the rung's reason says it
        ):
            return trace(model, length, (length, length), "specialised")
    except CtxcError as exc:
        raise UntraceableError(
            _every_rung((branch, *reasons), *tried, f"specialised ({length} tokens): {_short(exc)}")
        ) from exc


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Raise logger ``name`` to ERROR for the block, then restore its level."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _every_rung(reasons: tuple[str, ...], *more: str) -> str:
    return "every export rung failed: " + "; ".join((*reasons, *more))


def _branch(exc: BaseException) -> str:
    """The data-dependent branch an export stopped at: guard, and the model's line that asks it."""
    text = _text(exc)
    guard = _DATA_DEPENDENT.search(text)
    call = _CALL.search(text)
    where = ""
    if call:
        path = call.group(1).split("/models/")[-1].split("site-packages/")[-1]
        where = f" at {path}:{call.group(2)} `{call.group(3).strip()}`"
    return (
        f"the forward pass branches on tensor values ({guard.group(1) if guard else '?'}{where}): "
        "no graph holds for every input"
    )


def suggested_range(exc: BaseException, current: tuple[int, int]) -> tuple[int, int] | None:
    """The ``seq`` range that ``torch.export``'s "Suggested fixes" give, or None.

    Args:
        exc: the export error (its cause chain is searched too).
        current: the range that failed; bounds the suggestion leaves out are kept from it.

    Returns:
        ``(min, max)``, or None when there is no suggestion or it fixes ``seq`` to a constant.
    """
    match = _SUGGESTED.search(_text(exc))
    if match is None:
        return None
    bounds = dict(_BOUND.findall(match.group(1)))
    lo, hi = int(bounds.get("min", current[0])), int(bounds.get("max", current[1]))
    return (lo, hi) if lo < hi else None


def build_frontend(
    model: torch.nn.Module, locate: Callable[[TracedModel], BlocksT]
) -> Frontend[BlocksT]:
    """Run the ladder's first two rungs on ``model``; the third happens per length on demand.

    Args:
        model: the causal LM.
        locate: the block locator (``locate_blocks``), applied to every export.

    Returns:
        the :class:`Frontend`. When both shared rungs fail, a static export at 8 tokens is made
        at once, so a model that no rung can export fails here with every rung's reason.
    """
    import weakref

    top = longest_input(model)
    reasons: list[str] = []
    try:
        traced = trace(model, seq_range=(1, top))
        return Frontend((traced, locate(traced)), (), weakref.ref(model), locate)
    except CtxcError as exc:
        reasons.append(f"dynamic [1, {top}]: {_short(exc)}")
        fixed = _FIXED.search(_text(exc))
        branch = _branch(exc) if _DATA_DEPENDENT.search(_text(exc)) else ""
        if branch:  # a branch on values, not on the length: no range or static export helps
            reasons.append("bounded, static: not tried (a data-dependent branch)")
            queue: list[tuple[int, int] | None] = []
        elif fixed:  # the guards pin seq to the example's length: no range holds
            reasons.append(f"bounded: not tried, torch.export suggests {fixed.group(0)}")
            queue = []
        else:
            queue = [suggested_range(exc, (1, top)), (1, top - 1), (2, top), (2, top - 1)]
    tried: set[tuple[int, int]] = set()
    while queue and len(tried) < _MAX_TRIES:
        rng = queue.pop(0)
        if rng is None or rng in tried or rng[0] >= rng[1]:
            continue
        tried.add(rng)
        try:
            traced = trace(model, seq_range=rng, frontend="bounded")
            return Frontend((traced, locate(traced)), tuple(reasons), weakref.ref(model), locate)
        except CtxcError as exc:
            reasons.append(f"bounded [{rng[0]}, {rng[1]}]: {_short(exc)}")
            queue.insert(0, suggested_range(exc, rng))
    frontend = Frontend(None, tuple(reasons), weakref.ref(model), locate, branch=branch)
    frontend.traced_for(None)
    return frontend


def _text(exc: BaseException | None) -> str:
    """The messages of ``exc`` and its causes."""
    text = ""
    while exc is not None:
        text += str(exc) + "\n"
        exc = exc.__cause__
    return text


def _short(exc: BaseException) -> str:
    """The export error's first line, and the first guard it names (the value that failed)."""
    cause = exc.__cause__ or exc
    lines = [ln.strip() for ln in str(cause).splitlines() if ln.strip()]
    first = str(exc).removeprefix("torch.export could not trace this model: ")
    guard = next((ln for ln in lines if ln.startswith("- ")), "")
    return first + (f" ({guard[2:202]})" if guard else "")
