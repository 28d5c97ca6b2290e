"""Frontend: export a Hugging Face decoder to a torch.fx graph with ``torch.export``.

The graph is exported with a dynamic sequence length (or a bounded range, or one static length:
``compiler/frontend/ladder.py`` climbs that ladder) and reused for the full (context + query) run
and
the reduced (query only) run when its range holds both. It is not decomposed, so ``aten.linear``
and the module paths in ``nn_module_stack`` survive for the locator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import fx
from torch.export import Dim, export
from torch.export.graph_signature import InputKind

from ctxc.core.errors import CtxcError
from ctxc.models.load import max_positions
from ctxc.models.offload import input_device, is_dispersed, meta_skeleton, weight_source
from ctxc.models.placement import Placer

__all__ = [
    "MAX_SEQ",
    "WRAPPED",
    "LiftedProgram",
    "LogitsOnly",
    "TracedModel",
    "longest_input",
    "no_cache",
    "trace",
]

# The wrapper holds the model under this attribute; parameter names in the graph signature
# carry it as a prefix, which `TracedModel` strips so names match `model.state_dict()`.
_WRAPPED = "model"
_MAX_SEQ = 32768
# Public names of the two above, for the passes and backends that need them.
WRAPPED = _WRAPPED
MAX_SEQ = _MAX_SEQ


class LogitsOnly(torch.nn.Module):
    """``forward(input_ids) -> logits``, without a KV cache, for export."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        setattr(self, _WRAPPED, model)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return getattr(self, _WRAPPED)(input_ids=input_ids).logits


class LiftedProgram(Protocol):
    """What ctxc reads of a lifted program: an ``ExportedProgram``, or the export cache's
    ``StoredProgram`` (``compiler/store/export_cache.py``) that rebuilds these three."""

    @property
    def graph_module(self) -> fx.GraphModule: ...

    @property
    def state_dict(self) -> Mapping[str, torch.Tensor]: ...

    @property
    def constants(self) -> Mapping[str, object]: ...


@dataclass(frozen=True)
class TracedModel:
    """An exported decoder and the mapping from graph inputs to model tensors.

    Attributes:
        program: the ``ExportedProgram`` (lifted: parameters are placeholders), or the
            ``StoredProgram`` of the export cache (``compiler/store/export_cache.py``).
        param_of: placeholder node name -> parameter name in ``model.state_dict()``.
        input_name: the placeholder name of ``input_ids``.
        dtype: the floating dtype of the model's parameters.
        frontend: the rung of the export ladder that produced it (``compiler/frontend/ladder.py``):
            ``dynamic``, ``bounded`` or ``static``.
        seq_range: the sequence lengths the export holds for, inclusive.
        source: for a model dispersed over devices and disk (``compiler/models/offload.py``), what
            each state name reads in a run (``source(name, traced value)``); None otherwise.
    """

    program: LiftedProgram
    param_of: dict[str, str]
    input_name: str
    dtype: torch.dtype
    _args: tuple[tuple[str, str, str], ...] = field(repr=False)
    frontend: str = "dynamic"
    seq_range: tuple[int, int] = (1, _MAX_SEQ)
    source: Callable[[str, object], object] | None = None

    def placer(self, input_ids: torch.Tensor) -> Placer | None:
        """A :class:`Placer` for a run of a dispersed model on ``input_ids``; else None."""
        return None if self.source is None else Placer(input_ids.device)

    @property
    def input_index(self) -> int:
        """The position of ``input_ids`` among :meth:`placeholder_values`."""
        return next(i for i, (kind, _, _) in enumerate(self._args) if kind == "input")

    def accepts(self, length: int) -> bool:
        """Whether this export holds for inputs of ``length`` tokens (its ``seq`` range)."""
        return self.seq_range[0] <= length <= self.seq_range[1]

    @property
    def arg_specs(self) -> tuple[tuple[str, str, str], ...]:
        """Per placeholder: ``("input", name, "")`` or ``("state", name, signature target)``."""
        return self._args

    @property
    def graph(self) -> fx.Graph:
        return self.program.graph_module.graph

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.program.graph_module

    def placeholder_values(self, input_ids: torch.Tensor) -> list[object]:
        """The flat argument list of the lifted graph: parameters, buffers, constants, ids.

        Args:
            input_ids: int64 [1, seq].

        Returns:
            one value per placeholder, in graph order: a tensor (parameters shared with the
            model), or for a dispersed model what :attr:`source` gives (a ``LazyWeight``).
        """
        state, consts = self.program.state_dict, self.program.constants
        values: list[object] = []
        for kind, _, target in self._args:
            if kind == "input":
                values.append(input_ids)
                continue
            value = state[target] if target in state else consts[target]
            if self.source is not None:  # a dispersed model: its weights where they live
                value = self.source(target.removeprefix(_WRAPPED + "."), value)
            values.append(value)
        return values

    def node(self, name: str) -> fx.Node:
        """The graph node called ``name``."""
        for n in self.graph.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


@contextlib.contextmanager
def _no_cache(model: torch.nn.Module) -> Iterator[None]:
    # Passing use_cache as a kwarg breaks export for models that take it through **kwargs
    # (block-shapes.md, export facts): set it on the config instead, and restore it after.
    # A multimodal model's language model reads its own text config: that one too (else it
    # builds a sliding-window cache whose guards pin the export's length).
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else None
    configs = [c for c in (config, text) if c is not None]
    configs = [c for i, c in enumerate(configs) if all(c is not d for d in configs[:i])]
    old = [getattr(c, "use_cache", None) for c in configs]
    for c in configs:
        c.use_cache = False
    try:
        yield
    finally:
        for c, value in zip(configs, old, strict=True):
            c.use_cache = value


# Public name, for the backends that export or run the model the same way.
no_cache = _no_cache


@contextlib.contextmanager
def _latent_kv_heads(model: torch.nn.Module) -> Iterator[None]:
    """Give multi-head latent attention one key head per query head while it is exported.

    MLA (DeepSeek V2/V3, MiniCPM3, ...) makes a key and a value head per query head in
    ``kv_b_proj``, whatever ``config.num_key_value_heads`` says, yet Transformers sets
    ``num_key_value_groups = heads // num_key_value_heads`` on the module. The plain SDPA call
    (no mask) passes ``enable_gqa`` with equal head counts, so nothing is repeated; under
    ``torch.export`` the mask is explicit and ``sdpa_attention.py`` repeats the keys and values
    ``num_key_value_groups`` times: 4 query heads against 8 key heads ("Attempting to broadcast
    a dimension of length 8 ... [1, 4]") at every rung. With groups of 1 the export computes
    what the plain forward does. Side effects: the attribute is restored on exit.
    """
    changed = []
    for module in model.modules():
        groups = getattr(module, "num_key_value_groups", None)
        proj, heads = getattr(module, "kv_b_proj", None), getattr(module, "num_heads", None)
        if groups in (None, 1) or not isinstance(proj, torch.nn.Linear) or not heads:
            continue
        per_head = getattr(module, "qk_nope_head_dim", 0) + getattr(module, "v_head_dim", 0)
        if proj.out_features == heads * per_head:  # one key and value head per query head
            changed.append((module, groups))
            # torch types a module's attributes as tensors or modules (its __getattr__); this
            # one is the attention's int.
            module.num_key_value_groups = 1  # type: ignore[assignment]
    try:
        yield
    finally:
        for module, groups in changed:
            module.num_key_value_groups = groups


def trace(
    model: torch.nn.Module,
    example_len: int = 8,
    seq_range: tuple[int, int] | None = None,
    frontend: str = "dynamic",
    wrapper: torch.nn.Module | None = None,
    example: torch.Tensor | None = None,
) -> TracedModel:
    """Export ``model`` as ``input_ids [1, seq] -> logits [1, seq, vocab]``.

    Args:
        model: a causal LM whose ``forward(input_ids=...)`` returns an object with ``.logits``.
        example_len: length of the example input used for tracing (not 0 or 1, which
            ``torch.export`` would specialise, unless the export is static).
        seq_range: ``(min, max)`` of the dynamic sequence length; default ``1`` to the config's
            maximum position; ``(n, n)`` exports a static graph for ``n`` tokens.
        frontend: the ladder rung recorded in the result.
        wrapper: the module to export in place of :class:`LogitsOnly` (same contract:
            ``forward(input_ids) -> logits``, the model held under ``WRAPPED``); the
            multimodal full run (``compiler/runs/image_run.py``) passes one.
        example: the wrapper's example input, when it takes another than token ids (the
            multimodal full run: ``inputs_embeds`` [1, n, d]); its length must be static.

    Returns:
        the :class:`TracedModel`. The model is left unmodified (its config's ``use_cache`` is
        restored).

    Raises:
        CtxcError: ``torch.export`` failed (the first line of its message); the original
            exception is its ``__cause__``.
    """
    model.eval()
    # A dispersed model is traced on a meta skeleton: no second copy of its weights, and no
    # accelerate hook loading them during the trace (compiler/models/offload.py).
    dispersed = is_dispersed(model)
    if wrapper is None:
        wrapper = LogitsOnly(meta_skeleton(model) if dispersed else model)
    wrapper = wrapper.eval()
    vocab = getattr(getattr(model, "config", None), "vocab_size", 2) or 2
    lo, hi = seq_range or (1, longest_input(model))
    length = min(max(example_len, lo), hi)
    ids = torch.arange(length, dtype=torch.long).remainder(vocab).unsqueeze(0)
    if not dispersed:
        ids = ids.to(input_device(model))
    ids = ids if example is None else example
    dynamic = None if lo == hi else {"input_ids": {1: Dim("seq", min=lo, max=hi)}}
    try:
        inner = getattr(wrapper, _WRAPPED)
        with _no_cache(inner), _latent_kv_heads(inner), torch.no_grad():
            program = export(wrapper, (ids,), dynamic_shapes=dynamic, strict=False)
    except Exception as exc:  # torch.export raises many types; all mean the same to a user
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CtxcError(f"torch.export could not trace this model: {first}") from exc

    prefix = _WRAPPED + "."
    param_of: dict[str, str] = {}
    args: list[tuple[str, str, str]] = []
    input_name = ""
    for spec in program.graph_signature.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            input_name = name
            args.append(("input", name, ""))
            continue
        target = spec.target
        if spec.kind == InputKind.PARAMETER:
            param_of[name] = target[len(prefix) :] if target.startswith(prefix) else target
        args.append(("state", name, target))
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    dtype = next(iter(dtypes)) if len(dtypes) == 1 else torch.float32
    source = weight_source(model) if dispersed else None
    return TracedModel(
        program, param_of, input_name, dtype, tuple(args), frontend, (lo, hi), source
    )


def longest_input(model: torch.nn.Module) -> int:
    """The longest input an export of ``model`` must hold: the model's positions
    (:func:`ctxc.models.load.max_positions`, a multimodal model's text config first), at most
    ``MAX_SEQ`` and at least 2."""
    found = max_positions(getattr(model, "config", None))
    return _MAX_SEQ if found is None else max(2, min(found[0], _MAX_SEQ))
