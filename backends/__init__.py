"""Emitters: Transformers model, ONNX, PEFT and serving LoRA, GGUF; the registry the CLI reads.

The registry names each backend, what it writes and the extra that brings its dependencies,
without importing them: ``ctxc --help`` and a usage error must not load torch or onnx.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from ctxc.core.errors import CtxcError

__all__ = ["BACKENDS", "Backend", "backend", "parse_backends", "precheck"]


@dataclass(frozen=True)
class Backend:
    """One artefact kind of ``--emit`` / ``--to``.

    Attributes:
        name: the value on the command line.
        writes: what it adds to a ``ctxc compile`` output folder.
        status: the progress line while it runs.
        emitter: ``"module:function"``, imported on first use. Every emitter but ``torch``
            takes ``(model, patch, out_dir, full=logits)`` and returns ``(path, figures)``.
        patchable: the same for ``--patchable``, when the backend has such a variant.
        extra: the pip extra that brings ``requires`` (``None``: the plain install has them).
        requires: import names the emitter needs.
        takes: keyword arguments the emitter takes besides ``full`` (``tokenizer``,
            ``gguf_type``, ``baked``: the compile's patched logits), passed by ``emit_checked``
            when given.
        precheck: ``"module:function"`` taking the model, run before any compile: raises a
            CtxcError for a model the backend cannot write (an unknown GGUF architecture).
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

    def require(self, flag: str = "--emit") -> None:
        """Raise a one-line CtxcError naming the extra when a dependency is not installed."""
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            raise CtxcError(
                f"{flag} {self.name} needs {', '.join(missing)}: pip install 'ctxc[{self.extra}]'"
            )

    def load(self, patchable: bool = False) -> Callable:
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
            status="writing model/",
            emitter="ctxc.backends.torch.model:emit_torch",
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
