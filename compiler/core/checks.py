"""Where every artefact's check meets its threshold, and what a failed one leaves behind.

Each emitter measures its artefact (onnxruntime against the torch patched model, Transformers'
GGUF loader, PEFT merged, ...) and compares the figure with its bound through :func:`enforce`;
:func:`gate` then compares each artefact's fidelity to the full context with the patch's own
solver figure plus a runtime slack. A figure beyond its bound raises :class:`CheckFailed`, one
line naming the artefact and the figure. ``CTXC_TEST_FAIL_CHECK=KIND`` (an ``--emit`` name or
an artefact's file name) makes that artefact's checks fail here, and only here: the tests use
it to prove that a failed check of each kind exits non-zero with nothing of it written.

:func:`staged` writes an artefact into a folder of its own inside the output's staging folder
and moves it up only once it passed: a failed artefact is never left among the outputs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from ctxc.core.errors import CtxcError, environment_oserror
from ctxc.core.thresholds import RUNTIME_SLACK
from ctxc.core.vocabulary import EXACT_RULES

__all__ = [
    "EXACT_RULES",
    "FAIL_ENV",
    "RUNTIME_SLACK",
    "ArtefactError",
    "CheckFailed",
    "enforce",
    "fidelity_limit",
    "gate",
    "staged",
]

FAIL_ENV = "CTXC_TEST_FAIL_CHECK"

# The --emit kind whose artefact :func:`staged` is writing: ``CTXC_TEST_FAIL_CHECK=KIND`` fails
# every check met inside it, whatever the artefact's name (``patchable.onnx`` of ort-adapter).
_STAGING: ContextVar[str | None] = ContextVar("ctxc_staging", default=None)
_HALF = {"F16": "float16", "BF16": "bfloat16"}


class ArtefactError(CtxcError):
    """An artefact could not be written or failed its check; the patch itself is good.

    Attributes:
        artefact: what failed (``model.onnx``, ``adapter/``, ...).
        passed: the figures of the artefacts that passed before it, by ``--emit`` kind.
    """

    def __init__(self, artefact: str, message: str, passed: dict | None = None) -> None:
        super().__init__(message)
        self.artefact = artefact
        self.passed = dict(passed or {})


class CheckFailed(ArtefactError):
    """An artefact's measured figure is beyond its bound."""


def enforce(artefact: str, figure: str, value: float, limit: float, detail: str = "") -> None:
    """Raise :class:`CheckFailed` unless ``value <= limit`` (NaN fails too).

    Args:
        artefact: the artefact's name in the message (``model.onnx``).
        figure: what ``value`` is (``max |diff| from the torch patched model at 1 tokens``).
        value: the measured figure.
        limit: its bound.
        detail: more figures for the message (``mean 2e-4``), or empty.

    Raises:
        CheckFailed: ``model.onnx check failed: FIGURE VALUE > LIMIT (DETAIL)``; also when
            ``CTXC_TEST_FAIL_CHECK`` names the artefact or the kind being staged (the message
            says so).
    """
    forced = os.environ.get(FAIL_ENV, "")
    is_forced = bool(forced) and forced in (artefact, _STAGING.get())
    if value <= limit and not is_forced:
        return
    notes = [detail] if detail else []
    if is_forced:
        notes.append(f"forced by {FAIL_ENV}={forced}")
    more = f" ({'; '.join(notes)})" if notes else ""
    message = f"{artefact} check failed: {figure} {value:.3g} > {limit:.3g}{more}"
    raise CheckFailed(artefact, message)


def fidelity_limit(meta, full, gguf_type: str | None = None) -> float | None:
    """The bound on an artefact's max |logit diff| from the full-context model.

    Args:
        meta: the patch's :class:`~ctxc.patch.PatchMeta`: its dtype, rule and solver figure.
        full: the full-context logits at the query positions [k, vocab].
        gguf_type: the artefact's matrix type when it rounds the weights (GGUF ``F16``).

    Returns:
        the solver's figure plus :data:`RUNTIME_SLACK`; None when there is nothing to compare
        with: a patch saved without its solver figure whose rule is not exact (``lora``, a
        baked thought patch).
    """
    expected = getattr(meta, "solver_max_abs_logit_diff", None)
    if expected is None:
        if meta.update not in EXACT_RULES:
            return None
        expected = 0.0  # an exact rule: the solver's figure is rounding
    dtypes = [meta.dtype, _HALF.get(gguf_type or "", "float32")]
    slack = max(RUNTIME_SLACK.get(d, RUNTIME_SLACK["bfloat16"]) for d in dtypes)
    return float(expected) + slack * max(1.0, float(full.abs().max()))


def gate(artefact: str, figures, meta, full, gguf_type: str | None = None) -> None:
    """Check each fidelity of an artefact's figures against :func:`fidelity_limit`.

    Args:
        artefact: its name in the message.
        figures: the emitter's figures: their ``fidelities()`` (``ctxc.backends.base.Figures``)
            name what is held to the bound.
        meta: the patch's metadata.
        full: the full-context logits at the query positions [k, vocab].
        gguf_type: the matrix type the artefact rounds its weights to (``gguf``, ``gguf-lora``).

    Raises:
        CheckFailed: a fidelity beyond its bound (or forced by ``CTXC_TEST_FAIL_CHECK``).
    """
    limit = fidelity_limit(meta, full, gguf_type)
    held = figures.fidelities()
    for name, fid in held.items():
        where = f" ({name})" if len(held) > 1 else ""
        enforce(
            artefact,
            f"max |logit diff| from the full context{where}",
            fid.max_abs_logit_diff,
            float("inf") if limit is None else limit,
            f"the solver's {meta.solver_max_abs_logit_diff:.3g} + the runtime's slack"
            if getattr(meta, "solver_max_abs_logit_diff", None) is not None
            else "",
        )


@contextmanager
def staged(tmp: Path, kind: str, artefact: str, passed: dict | None = None) -> Iterator[Path]:
    """A folder for one artefact inside ``tmp``; its entries move up into ``tmp`` on success.

    Args:
        tmp: the output's staging folder.
        kind: the ``--emit`` kind (names the folder).
        artefact: the artefact's name, for the error.
        passed: the figures of the artefacts that passed so far (carried by the error).

    Yields:
        the folder to write the artefact into.

    Raises:
        ArtefactError: the body raised a CtxcError (a CheckFailed as it is; another is
            prefixed with the artefact's name); the folder and all it held are removed.
    """
    sub = tmp / f".emit-{kind}"
    sub.mkdir()
    staging = _STAGING.set(kind)
    try:
        yield sub
    except CtxcError as exc:
        shutil.rmtree(sub, ignore_errors=True)
        if isinstance(exc, ArtefactError):
            exc.passed = dict(passed or {})
            raise
        raise ArtefactError(artefact, f"{artefact}: {exc}", passed) from None
    except OSError as exc:
        shutil.rmtree(sub, ignore_errors=True)  # the space a partial artefact held, freed
        if exc.filename is None and environment_oserror(exc) is exc:
            # A write deep in a library (a shard's pwrite) names no file: name the artefact.
            named = str(tmp / artefact) + ("/" if artefact.endswith("/") else "")
            raise OSError(exc.errno, exc.strerror, named) from exc
        raise
    except BaseException:
        shutil.rmtree(sub, ignore_errors=True)
        raise
    finally:
        _STAGING.reset(staging)
    for entry in sorted(sub.iterdir()):
        entry.rename(tmp / entry.name)
    sub.rmdir()
