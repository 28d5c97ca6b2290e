"""``ctxc route``: the patch that answers a question, or none (issues 36, 53).

``ctxc bake --route --context doc.txt --out DIR`` (``compiler/cli/bake.py``; the run is
``ctxc.bake.routed``) bakes a long document as one patch per chunk of paragraphs under
``DIR/chunks/<id>/`` with ``DIR/router.json`` beside them (``--route --chat --system doc.txt``:
each chunk a chat bake, the chunk its system turn); ``ctxc route DIR --query TEXT`` prints the
folder of the chunk the router (BM25+, ``ctxc.bake.route``) picks, whichever the mode. A
question outside the document's scope (``ctxc.bake.scope``: too little of its word information
is in the document) prints ``none``: the server answers it with the unpatched model, and the
patch does no harm there. A single bake's folder (its ``scope.json``) prints itself or ``none``.

No torch import at module level (``ctxc --help`` stays fast).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

__all__ = ["route_cmd"]


def route_cmd(
    folder: Path = typer.Argument(
        ..., help="A bake folder (its scope.json) or a routed bake folder (ctxc bake --route)."
    ),
    query: str = typer.Option(..., "--query", help="The question (the request's text) to route."),
    scores: bool = typer.Option(
        False, "--scores", help="Print the query's coverage and every chunk's BM25 score too."
    ),
    scope: bool = typer.Option(
        True,
        "--scope/--no-scope",
        help="Answer 'none' for a query outside the document's scope (the default), or send "
        "every query to a patch.",
    ),
    threshold: float | None = typer.Option(
        None,
        "--threshold",
        help="The least coverage of a query in scope, 0-1 (default: the bake's, 0.15).",
    ),
) -> None:
    """Print the folder whose patch answers --query, or 'none' (serve it unpatched)."""
    from ctxc.bake import CHUNKS_DIR, ROUTER_FILE, SCOPE_FILE, Router, Scope
    from ctxc.core.errors import CtxcError

    routed = (Path(folder) / ROUTER_FILE).is_file() or (Path(folder) / CHUNKS_DIR).is_dir()
    if not routed and not (Path(folder) / SCOPE_FILE).is_file():
        raise CtxcError(
            f"{folder} is not a routed bake (no {ROUTER_FILE}) nor a bake with a scope "
            f"(no {SCOPE_FILE}): give a ctxc bake's output folder"
        )
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise CtxcError(f"--threshold must be in [0, 1], not {threshold}")
    if not routed:
        gate = Scope.load(folder)  # a single bake: its scope alone decides
        if threshold is not None:
            gate = Scope(gate.words, threshold)
        if scores:
            typer.echo(f"coverage\t{gate.coverage(query):.3f}\t(threshold {gate.threshold})")
        typer.echo(str(folder) if gate.admits(query) or not scope else "none")
        return
    router = Router.load(folder)
    if threshold is not None:
        router = dataclasses.replace(router, scope=threshold)
    picked = router.route(query) if scope else router.pick(query)
    if scores:
        gate = router.document_scope()
        typer.echo(f"coverage\t{gate.coverage(query):.3f}\t(threshold {router.scope})")
        ranked = sorted(zip(router.ids, router.scores(query), strict=True), key=lambda x: -x[1])
        for cid, score in ranked:
            typer.echo(f"{cid}\t{score:.3f}")
    typer.echo("none" if picked is None else str(Path(folder) / CHUNKS_DIR / picked))
