"""What a bake is asked for and what it wrote: the stage's data types (torch-free).

:class:`BakeJob` is one request to :mod:`ctxc.bake.run` (or :mod:`ctxc.bake.routed`),
:class:`HeldOut` what its figures are measured on besides the fit data, :class:`BakeRun` the
folder it wrote with its report and summary lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ctxc.core.errors import CtxcError
from ctxc.core.options import BakeOptions

__all__ = ["BakeJob", "BakeRun", "HeldOut"]


@dataclass(frozen=True)
class HeldOut:
    """What a bake is measured on besides its fit data.

    Attributes:
        queries: held-out query texts (None: none).
        questions: held-out questions, asked as the fit asks them (their answers compared).
        samples: continuations sampled from the model fed the context (seed + 1), at least 0.
        off_topic: off the context (issue 53): as many continuations and as many questions
            the model writes from what the patched model is fed first alone (its BOS; seed +
            5), fed after the context (one set, ``off_topic``): the patched model should do
            there what the model reading the context does. At least 0.

    Raises:
        CtxcError: ``samples`` or ``off_topic`` below 0.
    """

    queries: tuple[str, ...] | None = None
    questions: tuple[str, ...] | None = None
    samples: int = 8
    off_topic: int = 4

    def __post_init__(self) -> None:
        for name in ("samples", "off_topic"):
            if getattr(self, name) < 0:
                raise CtxcError(
                    f"held-out {name.replace('_', '-')} must be at least 0 "
                    f"(got {getattr(self, name)})"
                )


@dataclass(frozen=True)
class BakeJob:
    """One bake request.

    Attributes:
        out: the output folder.
        context: the context text (a plain bake), or None.
        messages: a chat model's context turns (``{"role", "content"}``) instead of
            ``context``: the queries are user turns after them.
        chunks: ``(name, text)`` per chunk, for :func:`bake_additive` and routed bakes.
        queries: fit query texts (user turns, in a chat bake) besides the options' data.
        options: how the patch is made.
        held: what its figures are measured on besides the fit data.
        emit: the backends whose artefacts the folder gets, each checked.
        model: the model (alias, folder, ``.gguf``); None: the bundled one.
        force: replace an earlier ctxc output folder at ``out``.
    """

    out: Path
    context: str | None = None
    messages: tuple[dict, ...] | None = None
    chunks: tuple[tuple[str, str], ...] = ()
    queries: tuple[str, ...] | None = None
    options: BakeOptions = field(default_factory=BakeOptions)
    held: HeldOut = field(default_factory=lambda: HeldOut())
    emit: tuple[str, ...] = ("torch",)
    model: str | None = None
    force: bool = False


@dataclass(frozen=True)
class BakeRun:
    """What a bake wrote.

    Attributes:
        folder: the output folder, placed.
        report: its ``report.json`` as written (``figures``: the patch's against the unpatched
            control's; ``artefacts``: each emitted artefact's check); a routed bake's holds
            ``chunks``, each chunk's report by id.
        lines: the summary, a line per measured set (warnings where the patch did worse than
            no patch), then what the bake is (chunks; how to feed a chat bake).
    """

    folder: Path
    report: dict
    lines: list[str]
