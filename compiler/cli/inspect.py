"""``ctxc inspect``: every residual MLP block of a model, as text, JSON or an HTML page.

No torch import at module level (``ctxc --help`` stays fast).
"""

from __future__ import annotations

import sys

import typer

from ctxc.cli.options import DEVICE, DEVICE_MAP, MAX_MEMORY, MODEL, Format, placement_for
from ctxc.cli.progress import VERBOSE, finish, say, stage
from ctxc.cli.support import load

__all__ = ["inspect_cmd"]


def inspect_cmd(
    model: str | None = MODEL,
    fmt: Format = typer.Option(
        "text", "--format", help="text, json, or html (a page with a diagram per shape)."
    ),
    device: str = DEVICE,
    device_map: str = DEVICE_MAP,
    max_memory: str = MAX_MEMORY,
    verbose: bool = VERBOSE,
) -> None:
    """Report every residual MLP block: its shape, parts and roles, what ctxc patches per
    update rule, or why a block cannot be patched."""
    net, _ = load(model, "float32", placement_for(device, device_map, max_memory))
    from ctxc.inspect.inspection import inspect_model
    from ctxc.inspect.render_html import render_html
    from ctxc.inspect.render_json import render_json
    from ctxc.inspect.render_text import render_text

    stage("tracing the model")
    info = inspect_model(net)
    if fmt == "text":
        say(render_text(info))
    else:  # plain bytes on stdout: no console wrapping or markup in machine-read formats
        finish()  # the progress trail ends before the bytes go out
        sys.stdout.write(render_json(info) if fmt == "json" else render_html(info))
        sys.stdout.flush()
