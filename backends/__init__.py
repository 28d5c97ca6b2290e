"""Emitters: Transformers model, ONNX, PEFT and serving LoRA, GGUF; the registry the CLI reads.

The registry gathers what each backend folder declares of itself (``backends/base.py``: its name,
what it writes, the extra that brings its dependencies, its emitter), without importing what it
writes with: ``ctxc --help`` and a usage error must not load torch or onnx.
:func:`emit_checked` writes the asked artefacts, each checked where a user runs it and held to
the patch's own figure: ``ctxc compile`` (each context of a batch), ``ctxc export`` and ``ctxc
bake`` all emit through it, the torch model folder too (reloaded by plain Transformers).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ctxc.backends.base import Backend, Emitter, Figures
from ctxc.core.errors import CtxcError

if TYPE_CHECKING:
    import torch

    from ctxc.patch import Patch

__all__ = [
    "BACKENDS",
    "FOLDERS",
    "Backend",
    "Emitter",
    "Figures",
    "backend",
    "check_rules",
    "emit_checked",
    "emitted_by",
    "parse_backends",
    "precheck",
]


# The backends' folders, in the order ``--help`` lists their backends: each declares its own in
# its ``__init__.py`` (``DECLARED``, torch-free). A new backend is a folder and its name here.
FOLDERS = ("torch", "onnx", "peft", "gguf", "delta")


def _declared() -> dict[str, Backend]:
    """Every folder's declarations by name, in :data:`FOLDERS`' order."""
    found: dict[str, Backend] = {}
    for folder in FOLDERS:
        for b in importlib.import_module(f"{__name__}.{folder}").DECLARED:
            if b.name in found:
                raise ValueError(f"backend {b.name!r} declared twice (backends/{folder}/)")
            found[b.name] = b
    return found


BACKENDS: dict[str, Backend] = _declared()


def backend(name: str) -> Backend:
    """The registered backend called ``name``."""
    return BACKENDS[name]


def emitted_by(kinds: list[str]) -> str | None:
    """The kind among ``kinds`` whose figure is the report's ``emitted`` (:attr:`Backend.emitted`:
    the model folder reloaded), or None."""
    return next((k for k in kinds if BACKENDS[k].emitted), None)


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
        load = BACKENDS[name].precheck
        if load is not None:
            load()(model)


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

    The backend whose figure is the report's ``emitted`` goes first (``torch``: the model folder,
    reloaded), then the others in the order asked. Each emitter checks its artefact where a user
    runs it, and its fidelities to the full context (:meth:`Figures.fidelities`) are held to the
    patch's solver figure (``ctxc.core.checks.gate``); each writes into a folder of its own,
    moved into ``out_dir`` only once it passed.

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
            not None: ``tokenizer``, ``gguf_type``, ``baked``, ``folder``, ``bake_report``.

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
        from ctxc.backends.reference import reference_logits

        full = reference_logits(model, patch)
    figures: dict[str, Figures] = {}
    for b in (BACKENDS[k] for k in sorted(kinds, key=lambda k: not BACKENDS[k].emitted)):
        alone = b.alone is not None and extra.get("folder") == ""
        artefact, status = b.alone if alone and b.alone else (b.writes, b.status)
        if on_stage is not None:
            on_stage(status)
        with staged(out_dir, b.name, artefact, figures) as sub:
            given = {k: extra[k] for k in b.takes if extra.get(k) is not None}
            _, found = b.load(patchable)(model, patch, sub, full=full, **given)
            rounds = extra.get("gguf_type") if "gguf_type" in b.takes else None
            gate(artefact, found, patch.meta, full, rounds)
        figures[b.name] = found
    return figures
