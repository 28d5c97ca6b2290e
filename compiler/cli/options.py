"""The options several ``ctxc`` commands share, declared once, their choices, and the flags of
the library's parameters.

Each choice's values come from ``ctxc.core.vocabulary`` (one place per decision): typer lists
them in ``--help`` and refuses any other value with click's one-line message. The values
themselves are validated by the library (``ctxc.core.options``), whose errors name its own
parameters: :data:`FLAGS` maps each to the flag that sets it when the CLI prints one
(:func:`cli_message`). No torch import (``ctxc --help`` stays fast).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeAlias

import typer

from ctxc.core.errors import CtxcError
from ctxc.core.options import bake_fields
from ctxc.core.vocabulary import (
    DEFAULT_RULE,
    DTYPES,
    FORMATS,
    GGUF_TYPES,
    RULES,
)
from ctxc.models.devices import Placement

__all__ = [
    "CHAT",
    "DEVICE",
    "DEVICE_MAP",
    "DOCUMENT",
    "DTYPE",
    "FLAGS",
    "FORCE",
    "IMAGES",
    "MAX_MEMORY",
    "MESSAGES",
    "MODEL",
    "SYSTEM",
    "UPDATE",
    "DType",
    "Engine",
    "Format",
    "GgufType",
    "Update",
    "cli_message",
    "emit_help",
    "flag_of",
    "placement_for",
]

# A Literal of the vocabulary's names: typer makes it a choice and passes the plain string on.
# A type checker sees str (a Literal cannot be built from a tuple it has not read).
if TYPE_CHECKING:
    Update: TypeAlias = str
    DType: TypeAlias = str
    GgufType: TypeAlias = str
    Format: TypeAlias = str
    Engine: TypeAlias = str
else:
    Update = Literal[RULES]
    DType = Literal[tuple(DTYPES)]
    GgufType = Literal[tuple(GGUF_TYPES)]
    Format = Literal[tuple(FORMATS)]
    Engine = Literal["local", "ray"]  # where the lines of --contexts compile

# Declared once, taken by every command that loads a model or writes an output folder.
MODEL = typer.Option(
    None,
    "--model",
    help="Alias, model folder or .gguf file (default: the bundled Gemma 3 270M); for export and "
    "eval-bake, the model the patch was made on.",
)
FORCE = typer.Option(False, "--force", help="Replace an earlier ctxc output folder.")
# What compile and generate both take: the rule, the dtype, the images of the context.
UPDATE = typer.Option(DEFAULT_RULE, "--update", help="Update rule.")
DTYPE = typer.Option("float32", "--dtype", help="Model dtype.")
IMAGES = typer.Option(
    None, "--image", metavar="<path>", help="Image file (PNG, JPEG) in the context; repeat."
)

# A chat context (docs/chat.md), which compile and generate both take: rendered by the model's
# chat template, the query its next user turn.
CHAT = typer.Option(
    False, "--chat", help="Render context and query with the model's chat template."
)
SYSTEM = typer.Option(None, "--system", help="With --chat: UTF-8 file with the system prompt.")
DOCUMENT = typer.Option(
    None, "--document", help="With --chat: UTF-8 file with a document, as a first user turn."
)
MESSAGES = typer.Option(
    None,
    "--messages",
    help="With --chat: JSON file, a list of {role, content} (the last one the query when "
    "--query is not given).",
)

# --device, --device-map and --max-memory, which every model command takes: checked by
# ctxc.models.devices.Placement.parse before an output folder or a model is touched.
DEVICE = typer.Option(None, "--device", help="cpu (default), cuda, cuda:N or mps.")
DEVICE_MAP = typer.Option(
    None,
    "--device-map",
    help="auto, balanced or sequential: disperse the model over GPUs, CPU and disk (accelerate).",
)
MAX_MEMORY = typer.Option(
    None, "--max-memory", help="With --device-map: memory per device, e.g. 0=20GiB,cpu=60GiB."
)


def placement_for(
    device: str | None, device_map: str | None, max_memory: str | None, kinds=()
) -> Placement:
    """The checked placement of the options; a CtxcError names the bad one.

    Args:
        kinds: the artefacts asked for: ONNX and PEFT need the model in one place.
    """
    from ctxc.backends import backend

    placement = Placement.parse(device, device_map, max_memory)
    other = [k for k in kinds if not backend(k).dispersed]
    if placement.device_map is not None and other:
        raise CtxcError(
            f"--device-map writes the torch model folder only, not {', '.join(other)}: "
            "those exporters need the whole model in one place"
        )
    return placement


def emit_help(head: str) -> str:
    """The help of an artefact option (``--emit``, ``--to``), the same in every command.

    Built from the registry, so a new backend shows in every command's help without a line
    there; ``tests/cli/test_cli_modules.py`` checks that each command's option lists them all.

    Args:
        head: what the option takes, before the list (``Comma list of artefacts``).

    Returns:
        ``HEAD: torch (model/), onnx (model.onnx), ...``: each backend and what it writes, in
        the registry's order.
    """
    from ctxc.backends import BACKENDS  # the folders' declarations, torch-free

    kinds = ", ".join(f"{name} ({b.writes})" for name, b in BACKENDS.items())
    return f"{head}: {kinds}."


# The library's parameters (``ctxc.core.options``, ``Placement.parse``) -> the flags that set
# them: an error naming a parameter (``CtxcError.naming``) is printed with its flag.
FLAGS: dict[str, str] = {
    "update": "--update",
    "start_layer": "--start-layer",
    "skip_unpatchable": "--skip-unpatchable",
    "dtype": "--dtype",
    "gguf_type": "--gguf-type",
    "query": "--query",
    "device": "--device",
    "device_map": "--device-map",
    "max_memory": "--max-memory",
    "max_new_tokens": "--max-new-tokens",
    "gen_tokens": "--gen-tokens",
    "queries": "--queries",
    "rank_per_block": "--rank auto",
    # The batch run (ctxc.batch, ctxc.compile_many) and its output folder.
    "contexts": "--contexts",
    "out": "--out",
    "force": "--force",
    "resume": "--resume",
    "emit": "--emit",
    "engine": "--engine",
    "address": "--address",
    "workers": "--workers",
    "gpus_per_worker": "--gpus-per-worker",
}


# The bake's parameters: each BakeOptions field's flag is declared on the field (--rank auto is
# the command's way to set rank_per_block).
FLAGS.update(
    {f.name: f.metadata["flag"] for f in bake_fields() if f.metadata["flag"] is not None},
    rank_per_block="--rank auto",
)


def flag_of(param: str) -> str:
    """The flag that sets the library parameter ``param`` (the parameter's name if none)."""
    return FLAGS.get(param, param)


def cli_message(exc: CtxcError) -> str:
    """``exc``'s message as the CLI prints it: each library parameter named by its flag."""
    return exc.render(flag_of)
