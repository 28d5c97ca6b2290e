"""Coverage matrix: every ``*ForCausalLM`` class in Transformers, compiled on a tiny random model.

Enumerates the causal-LM auto mapping plus every ``*ForCausalLM`` name the package exports, builds
a tiny seeded float32 config for each by shrinking the class's defaults (a few per-family
overrides where the generic shrink fails), compiles a random context through ``ctxc.compile`` as
the CLI does, and sorts each class into exact / inexact / refused / failed / out of scope. Each
model runs in its own forked process with a timeout. Writes the records to
``benchmarks/results/coverage.json`` (``--out``) and, with ``--results``, the table to
``docs/results/coverage.md``, so a new Transformers release shows what it broke or added.

    python -m benchmarks.coverage.matrix [--only llama,gpt2] [--subset ci] [--jobs 1]
        [--timeout 120] [--out benchmarks/results] [--results docs/results/coverage.md]
        [--list] [--strict] [--merge] [--render]

``--merge`` reruns the selected entries into an existing ``coverage.json`` (after a fix);
``--render`` rewrites the table from it (as ``python -m benchmarks.coverage.render`` does).
``tests/pipeline/test_coverage.py`` runs the ``ci`` subset.

This file is the driver: the command line and one forked process per entry. The entries and
their classification: ``testbed/coverage/entries.py``; the tiny configs and the override
table: ``testbed/coverage/configs.py``; one entry's run and record:
``testbed/coverage/run_entry.py``; the reports: ``benchmarks/coverage/render.py``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks.coverage.render import main as render_main
from benchmarks.coverage.render import summarise, write_reports
from testbed.coverage.configs import OVERRIDES, build_model, tiny_config
from testbed.coverage.entries import CI_SUBSET, Entry, entries
from testbed.coverage.run_entry import FAINT, ROOT, TOL, cell, run_entry
from testbed.tables import commit, invocation

__all__ = [
    "CI_SUBSET",
    "FAINT",
    "OVERRIDES",
    "TOL",
    "Entry",
    "build_model",
    "cell",
    "entries",
    "main",
    "run_entry",
    "run_isolated",
    "summarise",
    "tiny_config",
    "write_reports",
]


def _child(entry: Entry, conn) -> None:
    import torch

    torch.set_num_threads(1)  # many children may share few cores
    conn.send(run_entry(entry))
    conn.close()


def run_isolated(entry: Entry, timeout: float) -> dict:
    """Run :func:`run_entry` in a forked process (imports inherited), killed after ``timeout``.

    Args:
        entry: the class to compile.
        timeout: seconds before the process is killed and the entry recorded as failed.

    Returns:
        the result record.
    """
    if entry.scope:
        return run_entry(entry)
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(entry, send), daemon=True)
    start = time.perf_counter()
    proc.start()
    send.close()
    rec = None
    if recv.poll(timeout):
        try:
            rec = recv.recv()
        except EOFError:
            rec = None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if rec is None:
        seconds = round(time.perf_counter() - start, 2)
        code = proc.exitcode
        if code is not None and code < 0 and seconds < timeout:
            why = f"killed by signal {-code} (out of memory?)"
            error = "Killed"
        else:
            why, error = f"no result within {timeout:g} s", "Timeout"
        rec = {
            "family": entry.family,
            "cls": entry.cls,
            "kind": entry.kind,
            "status": "failed",
            "stage": "process",
            "error": error,
            "message": why,
            "seconds": seconds,
        }
    return rec


def _run_all(todo: list[Entry], jobs: int, timeout: float, progress) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    # Threads only wait on forked children; the parent itself runs no torch op.
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [pool.submit(run_isolated, e, timeout) for e in todo]
        results = []
        for i, fut in enumerate(futures):
            rec = fut.result()
            progress(i + 1, len(todo), rec)
            results.append(rec)
    return results


def _versions() -> dict:
    import torch
    import transformers

    import ctxc

    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "ctxc": ctxc.__version__,
        "python": platform.python_version(),
    }


def _meta_args(argv: list[str] | None) -> str:
    """The command line as the report header shows it (without ``--out``: a local path)."""
    args = list(argv if argv is not None else sys.argv[1:])
    if "--out" in args:
        i = args.index("--out")
        del args[i : i + 2]
    return " ".join(a for a in args if not a.startswith("--out="))


def main(argv: list[str] | None = None) -> int:
    """Run the matrix (or a part of it) and write the reports.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).

    Returns:
        the exit code: 0, or 1 when ``--strict`` and an entry run is not exact.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma list of families (model types)")
    parser.add_argument("--subset", choices=["ci"], default=None)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per model")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "results"), help="folder for coverage.json"
    )
    parser.add_argument("--results", default=None, help="also write the table here (Markdown)")
    parser.add_argument("--list", action="store_true", help="print the entries and exit")
    parser.add_argument("--strict", action="store_true", help="exit 1 unless all run are exact")
    parser.add_argument(
        "--update", default="stable", help="the update rule compiled with (lora: MATH.md 10)"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="replace only these entries in an existing coverage.json (a rerun after a fix)",
    )
    parser.add_argument(
        "--render", action="store_true", help="render coverage.json's table and exit"
    )
    args = parser.parse_args(argv)
    if args.render:
        rendered = ["--json", str(Path(args.out) / "coverage.json")]
        return render_main(rendered + (["--results", args.results] if args.results else []))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["CTXC_COVERAGE_UPDATE"] = args.update  # read by run_entry in each child
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    import ctxc  # noqa: F401  (imported once here; forked children inherit it)

    wanted = set(CI_SUBSET) if args.subset == "ci" else set()
    wanted |= {f for f in args.only.split(",") if f}
    todo = entries(wanted)
    unknown = wanted - {e.family for e in todo}
    if unknown:
        parser.error(f"unknown families: {', '.join(sorted(unknown))}")
    if args.list:
        for e in todo:
            print(f"{e.family:28} {e.cls:44} {e.kind:18} {e.scope}")
        return 0

    def progress(i: int, n: int, rec: dict) -> None:
        print(f"[{i}/{n}] {rec['family']:26} {rec.get('seconds', 0):6.1f}s {cell(rec)[:140]}")
        sys.stdout.flush()

    start = time.perf_counter()
    results = _run_all(todo, args.jobs, args.timeout, progress)
    meta = {
        "versions": _versions(),
        "args": _meta_args(argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
        "seconds": time.perf_counter() - start,
        "timeout": args.timeout,
        "tolerance": TOL,
        "update": args.update,
        "shape": "2 layers, hidden 64, 4 heads (2 KV heads where grouped), head dim 16, "
        "intermediate 128, <= 4 experts with top-2, vocabulary 128, window 8",
    }
    if args.merge and (Path(args.out) / "coverage.json").exists():
        old = json.loads((Path(args.out) / "coverage.json").read_text())
        rerun = {(r["family"], r["cls"]) for r in results}
        kept = [r for r in old["results"] if (r["family"], r["cls"]) not in rerun]
        meta = {**old["meta"], "versions": meta["versions"], "date": meta["date"]}
        meta["commit"] = commit()
        meta["merged"] = [*old["meta"].get("merged", []), _meta_args(argv)]
        results = kept + results
    md = Path(args.results) if args.results else None
    here = invocation("benchmarks.coverage.matrix", argv)
    write_reports(results, meta, Path(args.out) / "coverage.json", md, here)
    s = summarise(results)
    print(json.dumps(s["counts"]))
    ran = [r for r in results if r["status"] != "out of scope"]
    return 1 if args.strict and any(r["status"] != "exact" for r in ran) else 0


if __name__ == "__main__":
    sys.exit(main())
