"""``ctxc compile --contexts FILE.jsonl``: many contexts, one model load and trace (issue 11).

Each line is a JSON object: ``context`` (required), ``query`` and ``name`` (optional). Every
good line gets DIR/<name>/, exactly what a single ``ctxc compile`` writes; DIR/index.json
lists every line with its status and headline figures. No torch import at module level.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from ctxc._version import __version__
from ctxc.cli_output import MARKER, output_folder
from ctxc.cli_progress import progress, stage
from ctxc.cli_support import emit_checked, err, out, reload_fidelity, written
from ctxc.errors import CtxcError
from ctxc.interrupts import pause_point

__all__ = ["compile_batch", "compile_into", "read_lines"]

_NAME = re.compile(r"[A-Za-z0-9._-]+")


@dataclasses.dataclass(frozen=True)
class Options:
    """The compile options shared by every context of a run."""

    update: str
    start_layer: int
    skip_unpatchable: bool
    kinds: list[str]
    gguf_type: str = "F32"
    images: tuple = ()  # decoded images of an image context (``ctxc compile --image``)
    placement: object = None  # a ctxc.devices.Placement: where the model is loaded


def compile_into(net, tokenizer, tmp: Path, text: str, query, opts: Options, **hooks):
    """Compile one context and write patch.safetensors, report.json and artefacts into ``tmp``.

    Returns:
        (the report as written, the emitted artefacts' figures).
    """
    import ctxc
    from ctxc.backends import precheck
    from ctxc.backends.torch_model import emit_torch
    from ctxc.vlm import auto_model_class

    precheck(net, opts.kinds)
    torch_out = "torch" in opts.kinds
    result = ctxc.compile(
        net,
        tokenizer,
        context=text,
        query=query,
        update=opts.update,
        start_layer=opts.start_layer,
        skip_unpatchable=opts.skip_unpatchable,
        images=list(opts.images) or None,
        # With model/ written, its reload measures the same weights at the same addresses
        # (README: 3.1e-6 both ways): the in-memory run would be a second forward pass and a
        # second materialisation of every patched weight for the same figure.
        verify=not torch_out,
        **hooks,
    )
    result.patch.save(tmp / "patch.safetensors")
    pause_point("writing")
    report = result.report
    measured = "the patched model in memory (no model/ written)"
    if torch_out:
        stage("writing model/ and reloading it")
        emit_torch(net, tokenizer, result.patch, tmp / "model")
        full = result.full_logits
        reloaded = reload_fidelity(tmp / "model", result.patch, report.dtype, full, net)
        report = dataclasses.replace(report, emitted=reloaded)
        measured = f"model/ reloaded with {auto_model_class(net.config).__name__}.from_pretrained"
    figures = emit_checked(
        net,
        result.patch,
        tmp,
        opts.kinds,
        full=result.full_logits,
        tokenizer=tokenizer,
        gguf_type=opts.gguf_type,
        baked=result.patched_logits,
    )
    data = report.to_dict()
    data["emitted_measured_on"] = measured
    data.update({kind: f.to_dict() for kind, f in figures.items()})
    (tmp / "report.json").write_text(json.dumps(data, indent=2) + "\n")
    return report, figures


def read_lines(path: Path) -> list[tuple[int, dict | None, str | None]]:
    """(line number, parsed entry or None, error or None) for every non-blank line of ``path``."""
    if path.is_dir():
        raise CtxcError(f"--contexts takes a JSON Lines file; {path} is a folder")
    if not path.is_file():
        raise CtxcError(f"contexts file not found: {path}")
    try:
        raw = path.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise CtxcError(f"contexts file is not UTF-8 text: {path} (byte {exc.start})") from None
    except OSError as exc:
        raise CtxcError(f"cannot read contexts file {path}: {exc.strerror}") from None
    numbered = [(n, line) for n, line in enumerate(raw, 1) if line.strip()]
    if not numbered:
        raise CtxcError(f"contexts file is empty: {path}")
    width = max(4, len(str(numbered[-1][0])))
    seen: set[str] = set()
    lines = []
    for n, line in numbered:
        entry, problem = _parse(line, n, width)
        if entry is not None:
            if entry["name"] in seen:
                entry, problem = None, f"duplicate name {entry['name']!r}"
            else:
                seen.add(entry["name"])
        lines.append((n, entry, problem))
    return lines


def _parse(line: str, n: int, width: int) -> tuple[dict | None, str | None]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"not JSON: {exc.msg} (column {exc.colno})"
    if not isinstance(obj, dict):
        return None, "not a JSON object"
    context, query = obj.get("context"), obj.get("query")
    name = obj.get("name", f"{n:0{width}d}")
    if not isinstance(context, str) or not context.strip():
        return None, "missing or empty 'context' (a non-empty string)"
    if query is not None and (not isinstance(query, str) or query == ""):
        return None, "'query' must be a non-empty string"  # " " is a query: real tokens
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        return None, f"bad name {name!r} (letters, digits, '.', '_', '-')"
    if name in ("index.json", MARKER):
        return None, f"bad name {name!r} (reserved)"
    return {"context": context, "query": query, "name": name}, None


def compile_batch(contexts: Path, out_dir: Path, model, dtype: str, force: bool, opts: Options):
    """Compile every line of ``contexts`` into ``out_dir``/<name>/; write index.json.

    Returns:
        the exit status: 0 when every line succeeded, 1 when some failed.
    """
    lines = read_lines(contexts)
    index = []
    with output_folder(out_dir, force, "compile") as tmp:
        from ctxc.cli_support import load

        net, tokenizer = load(model, dtype, opts.placement)
        with _progress() as bar:
            task = bar.add_task("contexts", total=len(lines))
            for n, entry, problem in lines:
                if entry is not None:
                    problem, figures = _one(net, tokenizer, tmp, entry, opts)
                row = {"line": n, "name": entry["name"] if entry else None}
                if problem is None:
                    row.update(status="ok", **figures, folder=entry["name"])
                else:
                    row.update(status="error", error=problem)
                    err.print(f"ctxc: error: line {n}: {problem}", **_PLAIN)
                index.append(row)
                bar.update(task, advance=1)
        (tmp / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    failed = sum(row["status"] == "error" for row in index)
    done = len(index) - failed
    if failed:
        err.print(
            f"compiled {done} of {len(index)} contexts; {failed} failed "
            f"(see {out_dir / 'index.json'})",
            **_PLAIN,
        )
        return 1
    kinds = ", ".join(written(opts.kinds))
    out.print(f"compiled {done} of {len(index)} contexts into {out_dir}/ ({kinds})", **_PLAIN)
    return 0


_PLAIN = {"highlight": False, "markup": False, "soft_wrap": True}


def _progress():
    """Contexts done of all and the rate, on the command's progress trail (cli_progress.py)."""
    return progress(rate="contexts/s")


def _one(net, tokenizer, tmp: Path, entry: dict, opts: Options):
    """(error or None, headline figures) for one context, written to tmp/<name>/."""
    import shutil

    folder = tmp / entry["name"]
    folder.mkdir()
    try:
        report, _ = compile_into(
            net, tokenizer, folder, entry["context"], entry["query"], opts, on_stage=pause_point
        )
    except CtxcError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        return " ".join(str(exc).split()), None
    entries = sorted(p.name for p in folder.iterdir())
    marker = {"written_by": f"ctxc {__version__}", "command": "compile", "entries": entries}
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    e, c = report.emitted, report.control
    figures = {
        "max_abs_logit_diff": e.max_abs_logit_diff,
        "total_variation": e.total_variation,
        "top1_match": e.top1_match,
        "control": {"max_abs_logit_diff": c.max_abs_logit_diff},
    }
    return None, figures
