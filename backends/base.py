"""What a backend declares of itself, and what its emitter and figures look like.

Each backend folder (``backends/torch/``, ``backends/onnx/``, ...) declares its backends in its
``__init__.py`` as :class:`Backend` values (``DECLARED``), torch-free: the registry
(``backends/__init__.py``) reads them without importing what they write with, so ``ctxc --help``
and a usage error load neither torch nor onnx. A declaration is the one place a backend's facts
live: its name, what it writes, the extra it needs, its emitter (which writes the artefact and
checks it where a user runs it) and how the rest of ctxc treats it (:attr:`Backend.emitted`,
:attr:`Backend.dispersed`, :attr:`Backend.rules`, :attr:`Backend.ranks`); its figures say which
of their fidelities the gate holds to the patch's figure (:meth:`Figures.fidelities`).

The emitter is declared as a loader: a function of the folder's ``__init__.py`` that imports
the emitter's module when called and returns the emitter (:data:`Loader`), so the declaration
stays torch-free and a type checker still sees that what it returns is an :class:`Emitter`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from ctxc.core.errors import CtxcError

if TYPE_CHECKING:
    from ctxc.core.metrics import Fidelity

__all__ = ["Backend", "Emitter", "Figures", "Loader", "Precheck", "require_installed"]


class Figures(Protocol):
    """What an emitter measured of its artefact: JSON for report.json, one line for the user."""

    def to_dict(self) -> dict: ...

    def summary(self) -> str: ...

    def fidelities(self) -> dict[str, Fidelity]:
        """The artefact's fidelities to the full context, by name, that ``ctxc.core.checks.gate``
        holds to the patch's own figure (a name is shown when there are several)."""
        ...


class Emitter(Protocol):
    """A backend's emitter: writes its artefact into ``out_dir`` and checks it.

    Called as ``emitter(model, patch, out_dir, full=logits, **takes)``: ``full`` is the
    full-context logits at the query positions [k, vocab]; ``takes`` the keyword arguments the
    backend declares (:attr:`Backend.takes`). Returns the artefact's path and its figures;
    raises a CtxcError (a CheckFailed for a figure beyond its bound).

    The signature is open (``*args, **kwargs``) because each emitter takes its own keywords,
    which a Protocol cannot list per backend; a type checker still holds the return type, and
    ``tests/backends/test_backend_registry.py`` checks the parameters of every emitter.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Path, Figures]: ...


# A declaration's emitter: a function that imports the emitter's module (torch, onnx, ...) when
# called, on first use, and returns the emitter. A function and not a "module:function" string:
# the declaration stays torch-free either way, and this way a type checker follows the import
# and checks that an Emitter comes back (a misspelt string failed only when that kind ran).
Loader: TypeAlias = Callable[[], Emitter]
# A declaration's precheck: the same, for a function that takes the model and raises a CtxcError
# for one the backend cannot write.
Precheck: TypeAlias = Callable[[], Callable[[Any], object]]


@dataclass(frozen=True)
class Backend:
    """One artefact kind of ``--emit`` / ``--to``, as its folder declares it.

    Attributes:
        name: the value on the command line.
        writes: what it adds to a ``ctxc compile`` output folder.
        meaning: what that is, in a few words (``a Transformers model folder``).
        status: the progress line while it runs.
        emitter: its :class:`Emitter`'s :data:`Loader` (called on first use).
        patchable: the same for ``--patchable``, when the backend has such a variant (the
            ``--patchable`` flag applies to the backends that declare one).
        extra: the pip extra that brings ``requires`` (``None``: the plain install has them).
        requires: import names the emitter needs.
        takes: keyword arguments the emitter takes besides ``full`` (``tokenizer``,
            ``gguf_type``, ``baked``: the compile's patched logits, ``folder``: where the torch
            model folder goes, ``bake_report``: a bake's report, for an artefact that describes
            what it holds), passed by the emit loop when given; a backend that takes
            ``gguf_type`` rounds its weights to it, and the gate's bound widens to match.
        precheck: a :data:`Precheck`: the loader of a function taking the model, run before
            any compile, that raises a CtxcError for a model the backend cannot write (an
            unknown GGUF architecture).
        alone: ``(artefact name, status)`` when the artefact is the output folder itself
            (``folder=""``: ``ctxc export --to torch``), for a backend that can be.
        also: the other files it writes beside ``writes``, for the closing ``wrote`` line (and
            the names its checks may give, as ``writes`` and ``alone``'s do).
        rules: the update rules whose patch it can hold (``None``: every rule), checked with
            the options before anything loads; a backend with rules holds linear weights only
            (a serving LoRA), so a thought patch for it must be linear-only too.
        ranks: the ranks its serving engine loads (one for every module; ``None``: any rank),
            which a thought patch's ``rank`` must be one of (``ctxc.bake.serve``).
        emitted: its check reloads the patched model as a user loads it: that figure is the
            report's ``emitted``, so it is written first, and a compile asked for it skips its
            own in-memory check (the same weights, measured twice).
        dispersed: it can write a model dispersed over devices (``--device-map``); the others
            need the whole model in one place.
    """

    name: str
    writes: str
    meaning: str
    status: str
    emitter: Loader
    patchable: Loader | None = None
    extra: str | None = None
    requires: tuple[str, ...] = ()
    takes: tuple[str, ...] = ()
    precheck: Precheck | None = None
    alone: tuple[str, str] | None = None
    rules: tuple[str, ...] | None = None
    ranks: tuple[int, ...] | None = None
    also: tuple[str, ...] = ()
    emitted: bool = False
    dispersed: bool = False

    def require(self, flag: str = "--emit") -> None:
        """Raise a one-line CtxcError naming the extra when a dependency is not installed."""
        require_installed(self.name, self.requires, self.extra, flag)

    def load(self, patchable: bool = False) -> Emitter:
        """The emitter function (the ``--patchable`` variant when asked and available), its module
        imported now."""
        loader = self.patchable if patchable and self.patchable else self.emitter
        return loader()


def require_installed(
    name: str, requires: tuple[str, ...], extra: str | None, flag: str = "--emit"
) -> None:
    """Raise a one-line CtxcError naming the extra when a module ``requires`` is not installed.

    :meth:`Backend.require` for a declaration; an emitter's module calls it with its folder's
    facts (it does not import its folder's declaration: that imports the emitter's module).

    Args:
        name: the backend's name on the command line.
        requires: import names the backend needs.
        extra: the pip extra that brings them.
        flag: the option that asked for it (``--emit``, ``--to``).

    Raises:
        CtxcError: ``--emit onnx needs onnxscript: pip install 'ctxc[onnx]'``.
    """
    missing = [m for m in requires if importlib.util.find_spec(m) is None]
    if missing:
        raise CtxcError(f"{flag} {name} needs {', '.join(missing)}: pip install 'ctxc[{extra}]'")
