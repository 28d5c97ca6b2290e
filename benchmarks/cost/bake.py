"""What a default ``ctxc bake`` costs a user: whole processes, quiet and beside another job.

Runs ``ctxc bake --context FILE`` (its defaults) ``--repeats`` times as new processes and prints
each one's wall seconds, the bake's own stage timings (``report.json``: data, targets, fit) and
its held-out figure beside the unpatched model's; then, with ``--loaded``, once at one thread
(``ctxc --threads 1``) on the quiet machine and twice while a busy process (a Python loop, one
core) runs beside it: at torch's default threads and at one. The context defaults to the first
paragraph of the vendored SQuAD subset (a 100-200-word paragraph, as issue 35 sizes it).

    python -m benchmarks.cost.bake [--context FILE] [--repeats 3] [--loaded] [--json FILE]
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

from testbed.tables import commit, invocation

ROOT = Path(__file__).resolve().parents[2]
SUBSET = ROOT / "benchmarks" / "data" / "squad" / "subset.json"


def one_bake(context: Path, out: Path, threads: int | None = None) -> dict:
    """A ``ctxc bake`` process with its defaults (at ``threads``, None: torch's default); its
    wall and CPU seconds, stage timings, figures."""
    root = ["--threads", str(threads)] if threads else []
    cmd = [sys.executable, "-m", "ctxc.cli.app", *root, "bake", "--context", str(context)]
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
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ctxc-bake-cost-"))
    context = args.context
    if context is None:
        context = work / "paragraph.txt"
        paragraph = json.loads(SUBSET.read_text())["paragraphs"][0]
        context.write_text(paragraph["context"], encoding="utf-8")
    rows = []
    for i in range(args.repeats):
        rows.append({"run": f"quiet {i + 1}", **one_bake(context, work / "out")})
        print(json.dumps(rows[-1]), flush=True)
    if args.loaded:
        rows.append({"run": "quiet, 1 thread", **one_bake(context, work / "out", 1)})
        print(json.dumps(rows[-1]), flush=True)
        for threads in (None, 1):
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                row = one_bake(context, work / "out", threads)
            finally:
                busy.kill()
                busy.wait()  # reaped here: its CPU time must not count in the next bake's
            rows.append({"run": "beside a busy loop", **row})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        doc = {"context": str(context), "commit": commit(), "command": invocation(
            "benchmarks.cost.bake"), "rows": rows}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
