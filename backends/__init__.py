"""Emitters: Transformers model, ONNX, PEFT and serving LoRA, GGUF; the registry the CLI reads.

The registry names each backend, what it writes and the extra that brings its dependencies,
without importing them: ``ctxc --help`` and a usage error must not load torch or onnx.
:func:`emit_checked` writes the asked artefacts, each checked where a user runs it and held to
the patch's own figure: ``ctxc compile`` (each context of a batch), ``ctxc export`` and ``ctxc
bake`` all emit through it, the torch model folder too (reloaded by plain Transformers).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ctxc.core.errors import CtxcError
from ctxc.core.vocabulary import LORA_RULE

if TYPE_CHECKING:
    import torch

    from ctxc.patch import Patch

__all__ = [
    "BACKENDS",
    "Backend",
    "Emitter",
    "Figures",
    "backend",
    "check_rules",
    "emit_checked",
    "parse_backends",
    "precheck",
]


class Figures(Protocol):
    """What an emitter measured of its artefact: JSON for report.json, one line for the user."""

    def to_dict(self) -> dict: ...

    def summary(self) -> str: ...


class Emitter(Protocol):
    """A backend's emitter: writes its artefact into ``out_dir`` and checks it.

    Called as ``emitter(model, patch, out_dir, full=logits, **takes)``: ``full`` is the
    full-context logits at the query positions [k, vocab]; ``takes`` the keyword arguments the
    backend declares (:attr:`Backend.takes`). Returns the artefact's path and its figures;
    raises a CtxcError (a CheckFailed for a figure beyond its bound).
    """

    def __call__(
        self,
        model: torch.nn.Module,
        patch: Patch,
        out_dir: Path,
        *,
        full: torch.Tensor | None = ...,
        **takes: Any,
    ) -> tuple[Path, Figures]: ...


@dataclass(frozen=True)
class Backend:
    """One artefact kind of ``--emit`` / ``--to``.

    Attributes:
        name: the value on the command line.
        writes: what it adds to a ``ctxc compile`` output folder.
        status: the progress line while it runs.
        emitter: ``"module:function"``, imported on first use: an :class:`Emitter`.
        patchable: the same for ``--patchable``, when the backend has such a variant.
        extra: the pip extra that brings ``requires`` (``None``: the plain install has them).
        requires: import names the emitter needs.
        takes: keyword arguments the emitter takes besides ``full`` (``tokenizer``,
            ``gguf_type``, ``baked``: the compile's patched logits, ``folder``: where the torch
            model folder goes), passed by :func:`emit_checked` when given.
        precheck: ``"module:function"`` taking the model, run before any compile: raises a
            CtxcError for a model the backend cannot write (an unknown GGUF architecture).
        alone: ``(artefact name, status)`` when the artefact is the output folder itself
            (``folder=""``: ``ctxc export --to torch``), for a backend that can be.
        also: the other files it writes beside ``writes``, for the closing ``wrote`` line.
        rules: the update rules whose patch it can hold (``None``: every rule), checked with
            the options before anything loads (:func:`check_rules`).
    """

    name: str
    writes: str
    status: str
    emitter: str
    patchable: str | None = None
    extra: str | None = None
    requires: tuple[str, ...] = ()
    takes: tuple[str, ...] = ()
    precheck: str | None = None
    alone: tuple[str, str] | None = None
    rules: tuple[str, ...] | None = None
    also: tuple[str, ...] = ()

    def require(self, flag: str = "--emit") -> None:
        """Raise a one-line CtxcError naming the extra when a dependency is not installed."""
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            raise CtxcError(
                f"{flag} {self.name} needs {', '.join(missing)}: pip install 'ctxc[{self.extra}]'"
            )

    def load(self, patchable: bool = False) -> Emitter:
        """The emitter function (the ``--patchable`` variant when asked and available)."""
        target = self.patchable if patchable and self.patchable else self.emitter
        module, function = target.split(":")
        return getattr(importlib.import_module(module), function)


# One entry per name of ``ctxc.core.vocabulary.BACKEND_NAMES``, in its order (what each name
# means is said there; tests/core/test_vocabulary.py holds them equal).
BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend(
            "torch",
            writes="model/",
            status="writing model/ and reloading it",
            emitter="ctxc.backends.torch.check:emit_torch_checked",
            takes=("tokenizer", "folder", "baked"),
            alone=("model folder", "writing the model folder and reloading it"),
        ),
        Backend(
            "onnx",
            writes="model.onnx",
            status="exporting model.onnx and checking it with onnxruntime",
            emitter="ctxc.backends.onnx.model:emit_onnx",
            patchable="ctxc.backends.onnx.patchable:emit_onnx_patchable",
            extra="onnx",
            requires=("onnx", "onnxruntime", "onnxscript"),
        ),
        Backend(
            "ort-adapter",
            writes="context.onnx_adapter",
            status="writing the onnxruntime adapter (and patchable.onnx) and checking it",
            emitter="ctxc.backends.onnx.ort_adapter:emit_ort_adapter",
            extra="onnx",
            requires=("onnx", "onnxruntime", "onnxscript"),
            also=("context.onnx_adapter.json", "patchable.onnx"),  # its record, its graph
        ),
        Backend(
            "peft",
            writes="adapter/",
            status="writing the PEFT adapter and checking it",
            emitter="ctxc.backends.peft.adapter:emit_peft",
            extra="peft",
            requires=("peft",),
            takes=("baked",),
        ),
        Backend(
            "lora",
            writes="lora/",
            status="writing the serving LoRA adapter and checking it",
            emitter="ctxc.backends.peft.lora_adapter:emit_lora",
            extra="peft",
            requires=("peft",),
            takes=("baked",),
            rules=(LORA_RULE,),  # linear weights only: no norm scale, bias or expert bank
        ),
        Backend(
            "gguf",
            writes="model.gguf",
            status="writing model.gguf and reloading it with Transformers",
            emitter="ctxc.backends.gguf.model:emit_gguf",
            takes=("tokenizer", "gguf_type"),
            precheck="ctxc.backends.gguf.names:gguf_arch",
        ),
        Backend(
            "gguf-lora",
            writes="lora.gguf",
            status="writing the llama.cpp LoRA GGUF and checking it",
            emitter="ctxc.backends.gguf.lora:emit_gguf_lora",
            takes=("tokenizer", "gguf_type"),
            precheck="ctxc.backends.gguf.names:gguf_arch",
            rules=(LORA_RULE,),
        ),
    )
}


def backend(name: str) -> Backend:
    """The registered backend called ``name``."""
    return BACKENDS[name]


def parse_backends(spec: str, flag: str = "--emit") -> list[str]:
    """The backend names of a comma list, checked: known, and their extras installed.

    Raises:
        CtxcError: an unknown or empty list, or a missing extra (before any model is loaded).
    """
    items = [k.strip() for k in spec.split(",")]
    if spec.strip() and "" in items:  # onnx,,peft or onnx, : a slip, not a shorter list
        raise CtxcError(
            f"invalid value for '{flag}': {spec!r} has an empty item; expected a comma list of "
            f"{', '.join(BACKENDS)}"
        )
    names = [k for k in items if k]
    unknown = [k for k in names if k not in BACKENDS]
    if unknown or not names:
        got = repr(unknown[0]) if unknown else "nothing"
        raise CtxcError(
            f"invalid value for '{flag}': {got}; expected a comma list of {', '.join(BACKENDS)}"
        )
    for name in names:
        BACKENDS[name].require(flag)
    return names


def check_rules(names: list[str], update: str, flag: str = "--emit") -> None:
    """Refuse, before anything loads, an artefact the update rule's patch cannot go into.

    ``lora`` and ``gguf-lora`` hold linear weights only, as serving engines' LoRA adapters do;
    every other rule may change a norm scale (Gemma's post norms), so only ``--update lora``
    is admitted there (it admits every kind). Known from the options alone: refused in a
    second, not after the compile (issue 34).

    Raises:
        CtxcError: one line naming the artefact, the rule and the rule to use.
    """
    for name in names:
        admits = BACKENDS[name].rules
        if admits is not None and update not in admits:
            raise CtxcError(
                f"{flag} {name} holds linear weights only, and --update {update} may change "
                f"norm scales: compile with --update {' or '.join(admits)} (it admits every "
                f"{flag} kind)"
            )


def precheck(model, names: list[str]) -> None:
    """Run the prechecks of the named backends on ``model`` (before the model is compiled).

    Raises:
        CtxcError: a backend cannot write this model.
    """
    for name in names:
        target = BACKENDS[name].precheck
        if target:
            module, function = target.split(":")
            getattr(importlib.import_module(module), function)(model)


def emit_checked(
    model: torch.nn.Module,
    patch: Patch,
    out_dir: Path,
    kinds: list[str],
    *,
    patchable: bool = False,
    full: torch.Tensor | None = None,
    on_stage: Callable[[str], None] | None = None,
    **extra: Any,
) -> dict[str, Figures]:
    """Write the artefacts of ``kinds`` into ``out_dir``, each checked; their figures by kind.

    ``torch`` goes first (the model folder, reloaded), then the others in the order asked. Each
    emitter checks its artefact where a user runs it, and its fidelity to the full context is
    held to the patch's solver figure (``ctxc.core.checks.gate``); each writes into a folder
    of its own, moved into ``out_dir`` only once it passed.

    Args:
        model: the model the patch was computed on (unpatched).
        patch: the patch.
        out_dir: the output's staging folder.
        kinds: the backend names (checked: :func:`parse_backends`).
        patchable: the ``--patchable`` variant where a backend has one.
        full: the full-context logits at the query positions, when the caller has them
            (``ctxc compile`` does); else one full pass, shared by every emitter.
        on_stage: called with each backend's status line.
        extra: the keyword arguments some emitters take (:attr:`Backend.takes`), passed when
            not None: ``tokenizer``, ``gguf_type``, ``baked``, ``folder``.

    Returns:
        kind -> the emitter's :class:`Figures`, in the order written.

    Raises:
        ArtefactError: an artefact failed (nothing of it is left in ``out_dir``); its
            ``passed`` holds the figures of those written before it.
    """
    from ctxc.core.checks import gate, staged

    if not kinds:
        return {}
    if full is None:
        from ctxc.backends.torch.verify import reference_logits

        full = reference_logits(model, patch)
    figures: dict[str, Figures] = {}
    for b in (BACKENDS[k] for k in sorted(kinds, key=lambda k: k != "torch")):
        alone = b.alone is not None and extra.get("folder") == ""
        artefact, status = b.alone if alone and b.alone else (b.writes, b.status)
        if on_stage is not None:
            on_stage(status)
        with staged(out_dir, b.name, artefact, figures) as sub:
            given = {k: extra[k] for k in b.takes if extra.get(k) is not None}
            _, found = b.load(patchable)(model, patch, sub, full=full, **given)
            gate(b.name, artefact, found, patch.meta, full, extra.get("gguf_type"))
        figures[b.name] = found
    return figures
