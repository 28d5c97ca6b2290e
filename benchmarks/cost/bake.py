"""What a default ``ctxc bake`` costs a user: whole processes, quiet and beside another job.

Runs ``ctxc bake --context FILE`` (its defaults) ``--repeats`` times as new processes and prints
each one's wall seconds, the bake's own stage timings (``report.json``: data, targets, fit) and
its held-out figure beside the unpatched model's; then, with ``--loaded``, once at one thread
(``ctxc --threads 1``) on the quiet machine and twice while a busy process (a Python loop, one
core) runs beside it: at torch's default threads and at one. The context defaults to the first
paragraph of the vendored SQuAD subset (a 100-200-word paragraph, as issue 35 sizes it). With
``--chat`` the paragraph is the system turn (``ctxc bake --chat --system FILE``) of ``--model``;
``--bake-args`` adds flags to every bake (``--bake-args=--no-on-policy``).

    python -m benchmarks.cost.bake [--context FILE] [--repeats 3] [--loaded] [--json FILE]
                                   [--model M] [--chat] [--bake-args "FLAGS"]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cost.contention import PYTHON_LOOP, busy
from testbed.tables import commit, invocation

ROOT = Path(__file__).resolve().parents[2]
SUBSET = ROOT / "benchmarks" / "data" / "squad" / "subset.json"


def one_bake(
    context: Path, out: Path, threads: int | None = None, model: str | None = None,
    chat: bool = False, extra: tuple[str, ...] = (),
) -> dict:  # fmt: skip
    """A ``ctxc bake`` process with its defaults (at ``threads``, None: torch's default; the
    context as a chat system turn with ``chat``); its wall and CPU seconds, stage timings,
    figures."""
    root = ["--threads", str(threads)] if threads else []
    given = ["--chat", "--system", str(context)] if chat else ["--context", str(context)]
    named = ["--model", model] if model else []
    cmd = [sys.executable, "-m", "ctxc.cli.app", *root, "bake", *given, *named, *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    clock = time.perf_counter()
    subprocess.run([*cmd, "--out", str(out), "--force"], check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - clock
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    report = json.loads((out / "report.json").read_text())
    held = report["figures"]["held_out_samples"]
    return {
        "threads": threads or "default",
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "timings": report["timings"],
        "held_out_kl": held["patched"]["kl"],
        "held_out_kl_unpatched": held["control"]["kl"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=Path, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loaded", action="store_true", help="one more run beside a busy loop")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--model", default=None, help="alias, folder or .gguf (default: bundled)")
    parser.add_argument("--chat", action="store_true", help="the paragraph as the system turn")
    parser.add_argument("--bake-args", default="", help="more ctxc bake flags, one string")
    args = parser.parse_args()
    how = {"model": args.model, "chat": args.chat, "extra": tuple(args.bake_args.split())}
    work = Path(tempfile.mkdtemp(prefix="ctxc-bake-cost-"))
    context = args.context
    if context is None:
        context = work / "paragraph.txt"
        paragraph = json.loads(SUBSET.read_text())["paragraphs"][0]
        context.write_text(paragraph["context"], encoding="utf-8")
    rows = []
    for i in range(args.repeats):
        rows.append({"run": f"quiet {i + 1}", **one_bake(context, work / "out", **how)})
        print(json.dumps(rows[-1]), flush=True)
    if args.loaded:
        rows.append({"run": "quiet, 1 thread", **one_bake(context, work / "out", 1, **how)})
        print(json.dumps(rows[-1]), flush=True)
        for threads in (None, 1):
            with busy(1, PYTHON_LOOP):
                row = one_bake(context, work / "out", threads, **how)
            rows.append({"run": "beside a busy loop", **row})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        doc = {"context": str(context), "commit": commit(), "command": invocation(
            "benchmarks.cost.bake"), "rows": rows}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
