"""Helpers of the ``ctxc`` commands: input checks, model loading with progress, outputs.

Nothing here imports torch or Transformers at module level: ``ctxc --help`` must stay fast.
"""

from __future__ import annotations

from pathlib import Path

from ctxc.cli.progress import err, out, quiet_libraries, stage
from ctxc.core.interrupts import pause_point
from ctxc.core.textfile import read_text
from ctxc.core.vocabulary import PATCH_FILE, REPORT_FILE

__all__ = [
    "chat_input",
    "check_chat",
    "err",
    "load",
    "out",
    "parse_emit",
    "read_context",
    "summaries",
    "written",
]


def read_context(path: Path) -> str:
    """The UTF-8 text of ``path`` (``ctxc.core.textfile.read_text``: one line naming the file
    for a missing, unreadable, empty or binary one)."""
    return read_text(path, "context file")


def chat_input(
    chat: bool, system: Path | None, document: Path | None, messages: Path | None, query
) -> tuple[list[dict], str] | None:
    """The chat context of ``--chat`` (its files read and checked now, before a model loads):
    ``(context turns, query)``, or None without ``--chat``.

    Raises:
        CtxcError: ``--system``/``--document``/``--messages`` without ``--chat``, ``--chat``
            without any of them, a bad file, an empty part, or no query.
    """
    from ctxc.core.chat import chat_messages, read_messages
    from ctxc.core.errors import CtxcError

    given = [f for f, v in (("--system", system), ("--document", document)) if v is not None]
    if messages is not None:
        given.append("--messages")
    if not chat:
        if given:
            raise CtxcError(f"{given[0]} applies with --chat")
        return None
    if not given:
        raise CtxcError("--chat needs --system, --document or --messages (the context)")
    if messages is not None and len(given) > 1:
        raise CtxcError(
            "--messages holds the whole conversation: give it without --system "
            "and --document (a system turn goes in the list)"
        )
    if messages is not None:
        return chat_messages(messages=read_messages(messages), query=query)
    # A file's final line ending is the editor's, not the message's (a chat API's string).
    return chat_messages(
        system=None if system is None else read_text(system, "system prompt file").rstrip("\r\n"),
        document=None if document is None else read_text(document, "document file").rstrip("\r\n"),
        query=query,
    )


def check_chat(model: str | None, turns: list[dict], query: str) -> None:
    """Split a text conversation by the model's chat template with its tokenizer alone, before
    the model loads: a tokenizer without a template, or a template that refuses the
    conversation, is one line in a second or two, not after the model's load (issue 34).

    Raises:
        CtxcError: no chat template, the template refuses the conversation or cannot be split.
    """
    from ctxc.core.chat import NO_TEMPLATE
    from ctxc.core.errors import CtxcError

    stage(f"reading the tokenizer of {model or 'the bundled model'}")
    from ctxc.core.chat import split_chat
    from ctxc.models.load import declares_chat_template, load_tokenizer, model_directory

    def on_stage(line: str) -> None:  # a first-run GGUF conversion: torch, Transformers
        quiet_libraries()
        stage(line, keep=True)

    # The files first (no torch import: about half a second), then the tokenizer itself.
    if not declares_chat_template(model_directory(model, on_stage)):
        raise CtxcError(NO_TEMPLATE)
    quiet_libraries()
    split_chat(load_tokenizer(model, on_stage), turns, query)


def parse_emit(emit: str, flag: str = "--emit") -> list[str]:
    """The backend names of a comma list; a CtxcError for an unknown one or a missing extra."""
    from ctxc.backends import parse_backends

    return parse_backends(emit, flag)


def load(model: str | None, dtype: str, placement=None):
    """Load the model, saying so on stderr; a one-time GGUF conversion is announced as such.

    The model is enabled for the export cache and the frozen shards of ``model/``
    (:func:`ctxc.store.model_load.load_with_stores`).

    Args:
        placement: a :class:`~ctxc.models.devices.Placement` (checked already), or None: the CPU.

    Returns:
        ``(model, tokenizer)``.
    """
    pause_point("loading")
    stage(f"loading {model or 'the bundled model'}, {dtype}")
    quiet_libraries()  # imports torch: seconds, said above
    from ctxc.store.model_load import load_with_stores

    # Conversion steps take minutes: each stays as a line, on a terminal too.
    return load_with_stores(model, dtype, placement, on_stage=lambda line: stage(line, keep=True))


def summaries(figures) -> list[str]:
    """Each artefact's summary line; a reason llama.cpp did not run, given by an earlier line
    already (``model.gguf`` and ``lora.gguf`` share it), is said once: later lines say
    ``as above``."""
    lines, said = [], set()
    for f in figures:
        line, why = f.summary(), getattr(f, "llama_cpp_skipped", None)
        if why:
            if why in said:
                line = line.replace(why, "as above")
            said.add(why)
        lines.append(line)
    return lines


def written(kinds: list[str]) -> list[str]:
    """What a ``ctxc compile`` with ``kinds`` writes, for its closing line."""
    from ctxc.backends import backend

    return [
        PATCH_FILE,
        REPORT_FILE,
        *(name for k in kinds for name in (backend(k).writes, *backend(k).also)),
    ]
