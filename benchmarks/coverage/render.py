"""The coverage matrix's reports: ``coverage.json`` (the records) and its Markdown table.

:func:`summarise` counts the records by status and groups refusals and failures by their reason
with paths and numbers blanked; :func:`write_reports` writes the JSON (data the benchmarks read
back, ``benchmarks/results/coverage.json``) and, when asked, the Markdown page
(``docs/results/coverage.md``), stamped with the commit, the date and the command
(``testbed/tables.py``). Run as a module it renders the page from an existing JSON:

    python -m benchmarks.coverage.render [--json benchmarks/results/coverage.json]
        [--results docs/results/coverage.md]

Without ``--results`` the page goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

from testbed.coverage.run_entry import FAINT, ROOT, TOL, cell, faint
from testbed.tables import invocation, stamp

__all__ = ["DEFAULT_JSON", "main", "markdown", "summarise", "write_reports"]

# Where the matrix keeps its records (``--out`` of ``benchmarks/coverage/matrix.py``).
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "coverage.json"


def _group_key(text: str) -> str:
    """A reason or message with module paths and numbers blanked, to group like with like."""
    text = re.sub(r"\b(?!aten\.)[\w-]+(\.[\w-]+){2,}\b", "<path>", text)
    text = re.sub(r"(?<![\w.])-?\d+(\.\d+)?(e[-+]?\d+)?\b", "#", text)
    return text[:200]


def summarise(results: list[dict]) -> dict:
    """Counts by status, and failures and refusals grouped by their normalised first line.

    Args:
        results: the records of :func:`run_entry`.

    Returns:
        ``counts``, ``refused`` and ``failed`` (group text -> sorted families).
    """
    counts = Counter(r["status"] for r in results)
    refused: dict[str, set[str]] = defaultdict(set)
    failed: dict[str, set[str]] = defaultdict(set)
    inexact: dict[str, float] = {}
    for r in results:
        if r["status"] == "refused":
            for reason in r.get("reasons", []):
                refused[_group_key(reason.split(": ", 1)[-1])].add(r["family"])
        elif r["status"] == "failed":
            failed[f"{r['error']}: {_group_key(r.get('message', ''))}"].add(r["family"])
        elif r["status"] == "inexact":
            inexact[r["family"]] = r["max_abs_logit_diff"]
    before = [r["family"] for r in results if r.get("stage") in ("config", "build", "forward")]
    return {
        "failed_before_ctxc": sorted(before),
        "exact_faint": sorted(r["family"] for r in results if r["status"] == "exact" and faint(r)),
        "classes": len({r["cls"] for r in results}),
        "entries": len(results),
        "counts": dict(counts),
        "refused": {k: sorted(v) for k, v in sorted(refused.items(), key=lambda kv: -len(kv[1]))},
        "failed": {k: sorted(v) for k, v in sorted(failed.items(), key=lambda kv: -len(kv[1]))},
        "inexact": inexact,
    }


def _blocks_cell(r: dict) -> str:
    b = r.get("blocks")
    if not b or "count" not in b:
        return ""
    kinds = ", ".join(f"{n}x {k}" for k, n in sorted(b["kinds"].items()))
    rejected = f", {b['rejected']} rejected" if b.get("rejected") else ""
    return f"{b['count']}: {kinds}{rejected}" if kinds else f"0{rejected}"


def write_reports(
    results: list[dict],
    meta: dict,
    json_path: Path,
    md_path: Path | None = None,
    command: str | None = None,
) -> None:
    """Write ``coverage.json`` and, with ``md_path``, its Markdown page.

    Args:
        results: the records, one per entry.
        meta: versions, settings and run time for the header.
        json_path: the JSON file (its folder is created).
        md_path: the Markdown page, or None: none written.
        command: the command the page's stamp names (default: this process's command line).

    Side effects: replaces both files whole.
    """
    summary = summarise(results)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "summary": summary, "results": results}
    json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    if md_path is not None:
        page = stamp(command or invocation("benchmarks.coverage.matrix")) + "\n"
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(markdown(results, meta, page))


def markdown(results: list[dict], meta: dict, stamped: str = "") -> str:
    """The Markdown page of the records: summary, reasons grouped, one row per class.

    Args:
        results: the records.
        meta: versions, settings and run time (``coverage.json``'s ``meta``).
        stamped: the stamp put under the title (:func:`testbed.tables.stamp`).
    """
    summary = summarise(results)
    v = meta["versions"]
    c = summary["counts"]
    rule = meta.get("update", "stable")
    title = "every `*ForCausalLM` class in Transformers" if rule == "stable" else "selected classes"
    lines = [
        f"# Coverage matrix ({rule} rule): {title}",
        "",
        *([stamped.rstrip("\n"), ""] if stamped else []),
        f"Measured by `python -m benchmarks.coverage.matrix {meta['args']}`"
        + (f" at commit `{meta['commit']}`" if meta.get("commit") else "")
        + f" with transformers {v['transformers']}, torch {v['torch']}, ctxc {v['ctxc']} "
        f"(Python {v['python']}), {meta['date']}, {meta['seconds']:.0f} s.",
        "",
        *(
            [f"Entries rerun since (merged): `{'`, `'.join(meta['merged'])}`.", ""]
            if meta.get("merged")
            else []
        ),
        f"Tiny random float32 models (the class's default config shrunk: {meta['shape']}; "
        "random norm weights and biases; seed 0), one random context of 23 ids and a one-token "
        f"query through `ctxc.compile` ({rule} rule). **exact**: the emitted model fed the query "
        f"alone is within {TOL:g} (max |logit diff|) of the model fed context + query; the "
        "unpatched control's figure is in brackets. Each class runs in its own process with a "
        f"{meta['timeout']:g} s timeout.",
        "",
        "## Summary",
        "",
        f"- `*ForCausalLM` classes: {summary['classes']} ({summary['entries']} model types "
        "with their class)",
    ]
    for status in ("exact", "inexact", "refused", "failed", "out of scope"):
        lines.append(f"- {status}: {c.get(status, 0)}")
        if status == "exact" and summary["exact_faint"]:
            lines[-1] += (
                f" (of which {len(summary['exact_faint'])} with an unpatched control within "
                f"{FAINT:g}: {', '.join(summary['exact_faint'])})"
            )
        if status == "failed" and summary["failed_before_ctxc"]:
            lines[-1] += (
                f" (of which {len(summary['failed_before_ctxc'])} before ctxc ran: the tiny "
                "config or the eager forward pass failed)"
            )
    lines += ["", "### Refusal reasons (families)", ""]
    lines += [f"- {k}: {', '.join(v)}" for k, v in summary["refused"].items()] or ["- none"]
    lines += ["", "### Failures, by error (families)", ""]
    lines += [f"- `{k}`: {', '.join(v)}" for k, v in summary["failed"].items()] or ["- none"]
    if summary["inexact"]:
        lines += ["", "### Inexact (max |logit diff|)", ""]
        lines += [f"- {k}: {x:.3g}" for k, x in sorted(summary["inexact"].items())]
    lines += [
        "",
        "## Matrix",
        "",
        "| family | class | kind | blocks found | result |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["family"], r["cls"])):
        text = cell(r).replace("|", "\\|")
        lines.append(f"| {r['family']} | {r['cls']} | {r['kind']} | {_blocks_cell(r)} | {text} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Render the Markdown page from a stored ``coverage.json``.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        0. Side effect: writes ``--results`` (or prints the page).
    """
    parser = argparse.ArgumentParser(description="Render coverage.json as Markdown.")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="the matrix's records")
    parser.add_argument("--results", type=Path, default=None, help="write the page here")
    args = parser.parse_args(argv)
    doc = json.loads(args.json.read_text())
    if args.results is None:
        sys.stdout.write(markdown(doc["results"], doc["meta"]))
        return 0
    page = stamp(invocation("benchmarks.coverage.render", argv), action="Rendered")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(markdown(doc["results"], doc["meta"], page + "\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
