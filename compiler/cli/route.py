"""``ctxc route``: the chunk of a routed bake whose patch answers a question (issue 36).

``ctxc bake --route --context doc.txt --out DIR`` (``compiler/cli/bake.py``; the run is
``ctxc.bake.routed``) bakes a long document as one patch per chunk of paragraphs under
``DIR/chunks/<id>/`` with ``DIR/router.json`` beside them (``--route --chat --system doc.txt``:
each chunk a chat bake, the chunk its system turn); ``ctxc route DIR --query TEXT`` prints the
folder of the chunk the router (BM25+, ``ctxc.bake.route``) picks, whichever the mode.

No torch import at module level (``ctxc --help`` stays fast).
"""

from __future__ import annotations

from pathlib import Path

import typer

__all__ = ["route_cmd"]


def route_cmd(
    folder: Path = typer.Argument(..., help="A routed bake folder (ctxc bake --route)."),
    query: str = typer.Option(..., "--query", help="The question to route."),
    scores: bool = typer.Option(False, "--scores", help="Print every chunk's BM25 score too."),
) -> None:
    """Print the folder of the chunk whose patch answers --query (a routed bake's router)."""
    from ctxc.bake import CHUNKS_DIR, Router

    router = Router.load(folder)
    picked = router.pick(query)
    if scores:
        ranked = sorted(zip(router.ids, router.scores(query), strict=True), key=lambda x: -x[1])
        for cid, score in ranked:
            typer.echo(f"{cid}\t{score:.3f}")
    typer.echo(str(Path(folder) / CHUNKS_DIR / picked))
