"""``ctxc bake --route`` and ``ctxc route``: a long document as one patch per chunk (issue 36).

``ctxc bake --route --context doc.txt --out DIR`` cuts the document into chunks of paragraphs
(:func:`~ctxc.bake.route.split_chunks`), bakes each alone with the command's fit options into
``DIR/chunks/<id>/`` (an ordinary bake folder: ``patch.safetensors``, ``report.json``, the
``--emit`` artefacts) and writes ``DIR/router.json``. ``--add DIR --context more.txt`` bakes
the new chunks with DIR's options beside the others; ``--remove DIR --chunk ID`` drops one;
neither touches another chunk's patch. ``ctxc route DIR --query TEXT`` prints the folder of the
chunk whose patch answers the question.

No torch import at module level (``ctxc --help`` stays fast).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import typer

from ctxc.cli.progress import say, stage, stage_progress
from ctxc.cli.support import load, read_context
from ctxc.core.errors import CtxcError
from ctxc.core.options import BakeOptions
from ctxc.store.output import output_folder

__all__ = ["CHUNKS_DIR", "is_routed", "route_cmd", "routed_bake", "routed_change"]

CHUNKS_DIR = "chunks"


def is_routed(folder: Path) -> bool:
    """Whether ``folder`` is a routed bake (it holds a router)."""
    from ctxc.bake.route import ROUTER_FILE

    return (Path(folder) / ROUTER_FILE).is_file()


def _chunks(paths: list[Path], chunk_words: int) -> list[tuple[str, str]]:
    """``(file name, chunk text)`` of every ``--context`` file's chunks, in order (read and cut
    before any model loads: a bad file is one line, at once)."""
    from ctxc.bake.route import split_chunks

    if not paths:
        raise CtxcError("missing option '--context' (--route cuts a document into chunks)")
    return [(p.name, c) for p in paths for c in split_chunks(read_context(p), chunk_words)]


def _bake_into(net, tokenizer, chunks, ids: list[str], opts: BakeOptions, root: Path, write):
    """Bake each chunk alone into ``root/chunks/<id>/`` with ``write`` (the bake command's own
    folder writer); the summary line of each."""
    from ctxc.bake.driver import bake

    lines = []
    for n, (cid, (name, text)) in enumerate(zip(ids, chunks, strict=True), 1):
        folder = root / CHUNKS_DIR / cid
        folder.mkdir(parents=True)
        stage(f"chunk {cid} ({n}/{len(chunks)}, from {name}, {len(text.split())} words)")
        with stage_progress("baking", "fitting") as (on_stage, on_block):
            result = bake(net, tokenizer, text, None, options=opts, on_stage=on_stage,
                          on_block=on_block)  # fmt: skip
        result.report["route"] = {"chunk": cid, "file": name, "words": len(text.split())}
        figures = write(net, tokenizer, result, folder)
        held = figures.get("held_out_samples") or figures.get("fit")
        kl = "" if held is None else (
            f": KL {held['patched']['kl']:.3g} (unpatched {held['control']['kl']:.3g})"
        )  # fmt: skip
        lines.append(f"chunk {cid} ({name}, {len(text.split())} words){kl}")
    return lines


def routed_bake(paths, opts: BakeOptions, chunk_words: int, kinds, model, out_dir, force, write):
    """``ctxc bake --route``: every chunk baked alone, the router beside them.

    Args:
        paths: the ``--context`` files (each cut into its own chunks).
        opts: the fit options, for every chunk.
        chunk_words: ``--chunk-words``.
        kinds: the ``--emit`` artefacts every chunk's folder gets (recorded for ``--add``).
        model, out_dir, force: the command's.
        write: ``write(net, tokenizer, result, folder) -> figures``: one chunk's folder.

    Side effects:
        writes ``out_dir`` (staged, placed when every chunk is baked).
    """
    from ctxc.bake.route import Router

    if opts.method == "additive":
        raise CtxcError("--route bakes each chunk alone: give --method fit or distill")
    chunks = _chunks(paths, chunk_words)
    with output_folder(out_dir, force, "bake") as tmp:
        net, tokenizer = load(model, "float32")
        router = Router((), (), dataclasses.asdict(opts), chunk_words, tuple(kinds))
        ids = router.next_ids(len(chunks))
        lines = _bake_into(net, tokenizer, chunks, ids, opts, tmp, write)
        router.added(ids, [t for _, t in chunks]).save(tmp)
    for line in [*lines, f"wrote {out_dir}/ ({len(chunks)} chunks; ctxc route {out_dir} "
                 "--query TEXT picks one)"]:  # fmt: skip
        say(line)


def routed_change(folder: Path, paths: list[Path], chunk: str | None, model, writer) -> None:
    """``--add DIR`` / ``--remove DIR`` on a routed bake: the new chunks baked with DIR's
    options and artefacts (``writer(kinds)`` writes one chunk's folder), or ``chunk`` dropped;
    the other chunks' folders kept as they are (hard links into the staged copy), DIR replaced
    once all of it is written."""
    from ctxc.bake.route import Router

    router = Router.load(folder)
    opts = BakeOptions(**router.options)  # every chunk's, checked before anything is written
    # Both checked (one line) before anything is written: the chunk to drop, or the new files.
    after = router.removed(chunk) if chunk is not None else None
    chunks = [] if chunk is not None else _chunks(paths, router.chunk_words)
    with output_folder(folder, True, "bake") as tmp:
        kept = [c for c in router.ids if c != chunk]
        for cid in kept:
            shutil.copytree(
                folder / CHUNKS_DIR / cid, tmp / CHUNKS_DIR / cid, copy_function=os.link
            )
        if after is not None:
            after.save(tmp)
            lines = [f"removed chunk {chunk}"]
        else:
            net, tokenizer = load(model, "float32")
            _check_same_model(folder / CHUNKS_DIR / kept[0] if kept else None, net)
            ids = router.next_ids(len(chunks))
            lines = _bake_into(net, tokenizer, chunks, ids, opts, tmp, writer(list(router.emit)))
            router.added(ids, [t for _, t in chunks]).save(tmp)
    for line in [*lines, f"wrote {folder}/ ({len(kept) + len(chunks)} chunks)"]:
        say(line)


def _check_same_model(chunk_folder: Path | None, net) -> None:
    """Refuse a model other than the one the routed bake's patches were made for."""
    if chunk_folder is None:
        return
    from ctxc.patch import Patch

    Patch.load(chunk_folder, net).check(net)


def route_cmd(
    folder: Path = typer.Argument(..., help="A routed bake folder (ctxc bake --route)."),
    query: str = typer.Option(..., "--query", help="The question to route."),
    scores: bool = typer.Option(False, "--scores", help="Print every chunk's BM25 score too."),
) -> None:
    """Print the folder of the chunk whose patch answers --query (a routed bake's router)."""
    from ctxc.bake.route import Router

    router = Router.load(folder)
    picked = router.pick(query)
    if scores:
        for cid, s in sorted(zip(router.ids, router.scores(query), strict=True),
                             key=lambda x: -x[1]):  # fmt: skip
            typer.echo(f"{cid}\t{s:.3f}")
    typer.echo(str(Path(folder) / CHUNKS_DIR / picked))
