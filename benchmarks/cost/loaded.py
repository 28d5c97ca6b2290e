"""What other jobs cost a ctxc command: its CPU seconds beside busy processes against quiet.

Issue 55's check: a default ``ctxc bake``, ``ctxc compile`` and ``compile --contexts``, each a
new process, spend within 1.5x the CPU seconds beside two busy processes (``--load``) that they
spend on the quiet machine. Each command runs quiet, then beside ``--load`` one-core Python loops
as ctxc chooses its threads (the cores the loops leave: ``compiler/core/threads.py``), then
beside them with ``OMP_NUM_THREADS`` set to torch's own default (the choice off: what every
command did before). CPU seconds are the command process's own (user + system, its children
included; the loops are reaped after each measurement). The bake's context is the vendored SQuAD
subset's first paragraph; the compile's ``examples/medium.txt``; ``--contexts`` takes
``--contexts`` windows of the example texts (``benchmarks/cost/cli.py``). The export cache is
warmed by one compile first (not measured).

    python -m benchmarks.cost.loaded [--load 2] [--contexts 4] [--only bake,compile,contexts]
                                     [--no-control] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cost.cli import contexts_file
from benchmarks.cost.contention import PYTHON_LOOP, busy
from testbed.tables import commit, invocation

ROOT = Path(__file__).resolve().parents[2]
SUBSET = ROOT / "benchmarks" / "data" / "squad" / "subset.json"
MEDIUM = ROOT / "examples" / "medium.txt"
COMMANDS = ("bake", "compile", "contexts")


def timed(cmd: list[str], env: dict) -> dict:
    """Wall and CPU seconds of ``cmd`` as a new process, and the thread line it printed."""
    os.sync()  # the last run's folder written back first, not during this one
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    clock = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - clock
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    chose = [line for line in proc.stderr.splitlines() if "torch thread" in line]
    return {"wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1), "chose": chose[:1]}


def commands(work: Path, contexts: int) -> dict[str, list[str]]:
    """Each measured command line (writing under ``work``)."""
    paragraph = work / "paragraph.txt"
    paragraph.write_text(json.loads(SUBSET.read_text())["paragraphs"][0]["context"], "utf-8")
    contexts_file(work / "contexts.jsonl", contexts)
    ctxc = [sys.executable, "-m", "ctxc.cli.app"]
    return {
        "bake": [*ctxc, "bake", "--context", str(paragraph), "--out", str(work / "bake")],
        "compile": [*ctxc, "compile", "--context", str(MEDIUM), "--out", str(work / "one")],
        "contexts": [
            *ctxc,
            "compile",
            "--contexts",
            str(work / "contexts.jsonl"),
            "--out",
            str(work / "many"),
        ],
    }


def physical_cores() -> int:
    """torch's default thread count (what ``OMP_NUM_THREADS`` is set to with the choice off)."""
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"},
    )
    return int(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=int, default=2, help="busy one-core loops beside")
    parser.add_argument("--contexts", type=int, default=4, help="lines of the --contexts run")
    parser.add_argument("--only", default=",".join(COMMANDS), help="commands, comma-separated")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-control", action="store_true", help="skip torch's own threads")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ctxc-loaded-"))
    cmds = commands(work, args.contexts)
    mine = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "CTXC_THREADS")
    auto = {k: v for k, v in os.environ.items() if k not in mine}
    fixed = {**auto, "OMP_NUM_THREADS": str(physical_cores())}
    timed([*cmds["compile"], "--force"], auto)  # the export cache warmed, not measured
    rows = []
    for name in args.only.split(","):
        cmd = [*cmds[name], "--force"]
        quiet = {"command": name, "run": "quiet", **timed(cmd, auto)}
        with busy(args.load, PYTHON_LOOP):
            chosen = {
                "command": name,
                "run": f"{args.load} busy, ctxc's threads",
                **timed(cmd, auto),
            }
        runs = [quiet, chosen]
        if not args.no_control:
            with busy(args.load, PYTHON_LOOP):
                spun = {
                    "command": name,
                    "run": f"{args.load} busy, torch's threads",
                    **timed(cmd, fixed),
                }
            runs.append(spun)
        for row in runs:
            row["cpu_vs_quiet"] = round(row["cpu_seconds"] / quiet["cpu_seconds"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        doc = {"commit": commit(), "command": invocation("benchmarks.cost.loaded"), "rows": rows}
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
