"""``--contexts`` on Ray against the local run (issue 26): the same folders, and the wall time.

Three runs of ``ctxc compile --contexts`` over N contexts made from benchmarks/data (a slice of
a text as the context, one of its questions as the query), each a new process:

* ``local``: the default engine, one model load;
* ``ray``: ``--engine ray --workers W`` on a local Ray the command starts itself;
* ``ray killed``: the same, with one worker killed (SIGKILL, a real signal to the actor's
  process) when its first line is half done; the run must finish with every line once and the
  loss in index.json (``attempts``, ``workers_lost``);
* ``resume``: the same, interrupted (SIGINT to the command) once ``--interrupt-after`` lines
  are done, then rerun with ``--resume``: the lines kept must not be compiled again.

Each Ray folder is compared with the local run's: every file byte for byte but report.json's
wall times and the markers. ``--emit peft`` by default (``torch`` writes a 1 GB model folder per
context).

    python -m benchmarks.cost.ray_batch [--contexts 40] [--workers 2] [--emit peft] [--model SPEC]
        [--local DIR] [--skip-ray] [--skip-kill] [--skip-resume] [--interrupt-after 8]
        [--keep DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "data"


def contexts(n: int) -> list[dict]:
    """N lines: word windows of the data texts as contexts, their questions as queries."""
    rows = []
    texts = sorted(DATA.glob("*_questions.txt"))
    for i in range(n):
        q = texts[i % len(texts)]
        words = (DATA / q.name.replace("_questions", "")).read_text().split()
        questions = [line for line in q.read_text().splitlines() if line.strip()]
        start = (i * 13) % max(1, len(words) - 40)
        rows.append(
            {
                "context": " ".join(words[start : start + 24 + i % 17]),
                "query": questions[i % len(questions)],
                "name": f"ctx{i:03d}",
            }
        )
    return rows


def command(src: Path, out: Path, args, *extra: str) -> list[str]:
    model = ["--model", args.model] if args.model else []
    head = [sys.executable, "-m", "ctxc.cli.app", "compile", "--contexts", str(src), *model]
    return [*head, "--out", str(out), "--emit", args.emit, *extra]


def timed(cmd: list[str], watch=None) -> tuple[float, int, str]:
    """(wall seconds, exit status, stderr) of ``cmd``; ``watch(proc)`` runs while it does."""
    os.sync()
    start = time.perf_counter()
    with open(os.devnull, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.PIPE, text=True)
        if watch is not None:
            watch(proc)
        err = proc.communicate()[1]
    return time.perf_counter() - start, proc.returncode, err


def differ(ours: Path, local: Path, names: list[str]) -> list[str]:
    """The files of ``names`` that are not byte-identical (report.json: but its timings)."""
    bad = []
    for name in names:
        for path in sorted((local / name).rglob("*")):
            if not path.is_file() or path.name == ".ctxc":
                continue
            mine = ours / name / path.relative_to(local / name)
            if path.name == "report.json":
                same = _untimed(json.loads(path.read_text())) == _untimed(
                    json.loads(mine.read_text())
                )
            else:
                same = mine.is_file() and mine.read_bytes() == path.read_bytes()
            if not same:
                bad.append(str(mine))
    return bad


def _untimed(report):
    """A report without its wall times (``timings``, an artefact's ``seconds``)."""
    if isinstance(report, dict):
        return {k: _untimed(v) for k, v in report.items() if k not in ("timings", "seconds")}
    return report


def line_workers(root: int) -> list[int]:
    """The pids of the processes below ``root`` titled ``ray::LineWorker.run``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "cmdline").read_bytes().startswith(b"ray::LineWorker.run"):
                continue
            pid = int(entry.name)
            while pid > 1 and pid != root:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if pid == root:
            found.append(int(entry.name))
    return found


def kill_one(out: Path, killed: list[int]):
    """A watcher: once a line's folder is half written (its patch in a staging folder), one
    compiling worker is killed with SIGKILL."""

    def watch(proc) -> None:
        while proc.poll() is None:
            half = out.is_dir() and any(
                (p / "patch.safetensors").exists() for p in out.glob(".*.partial-*")
            )
            workers = line_workers(proc.pid) if half else []
            if workers:
                os.kill(workers[0], signal.SIGKILL)
                killed.append(workers[0])
                return
            time.sleep(0.05)

    return watch


def interrupt_after(out: Path, k: int):
    """A watcher: SIGINT to the command once index.json lists ``k`` finished lines."""

    def watch(proc) -> None:
        while proc.poll() is None:
            try:
                rows = json.loads((out / "index.json").read_text())
            except (OSError, ValueError):
                rows = []
            if sum(r["status"] == "ok" for r in rows) >= k:
                proc.send_signal(signal.SIGINT)
                return
            time.sleep(0.05)

    return watch


def main() -> None:  # noqa: PLR0915 - a driver: its flags, then its stages in order
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--emit", default="peft")
    ap.add_argument("--model", default=None)
    ap.add_argument("--interrupt-after", type=int, default=8)
    ap.add_argument("--local", type=Path, default=None, help="an earlier local run's DIR")
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--skip-kill", action="store_true")
    ap.add_argument("--skip-resume", action="store_true")
    ap.add_argument("--keep", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="ctxc-ray-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = contexts(args.contexts)
    names = [r["name"] for r in rows]
    src = work / "contexts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ray = ["--engine", "ray", "--workers", str(args.workers)]
    result: dict = {"contexts": args.contexts, "workers": args.workers, "emit": args.emit}

    def step(label: str, out: Path, extra=(), watch=None, expect=0) -> float:
        seconds, rc, err = timed(command(src, out, args, *extra), watch)
        if rc != expect:
            sys.exit(f"{label}: exit {rc}, expected {expect}\n{err[-3000:]}")
        print(f"{label:<12} {seconds:7.1f} s", flush=True)
        result[f"{label} s"] = round(seconds, 1)
        return seconds

    local = args.local or work / "local"
    if args.local is None:
        step("local", local)
    if not args.skip_ray:
        step("ray", work / "ray", ray)
        result["ray differs"] = differ(work / "ray", local, names)
    if not args.skip_kill:
        killed: list[int] = []
        step("ray killed", work / "killed", ray, kill_one(work / "killed", killed))
        index = json.loads((work / "killed" / "index.json").read_text())
        result["killed pid"] = killed
        result["killed lost"] = [r for r in index if r.get("attempts")]
        result["killed lines"] = sorted(r["name"] for r in index if r["status"] == "ok")
        result["killed differs"] = differ(work / "killed", local, names)
    if not args.skip_resume:
        out = work / "resumed"
        step("interrupted", out, ray, interrupt_after(out, args.interrupt_after), expect=130)
        done = [n for n in names if (out / n).is_dir()]
        kept = {n: (out / n / "patch.safetensors").stat().st_mtime_ns for n in done}
        step("resume", out, [*ray, "--resume"])
        result["interrupted kept"] = len(kept)
        result["recompiled of kept"] = sorted(
            n for n, t in kept.items() if (out / n / "patch.safetensors").stat().st_mtime_ns != t
        )
        result["resumed differs"] = differ(out, local, names)
        result["resumed index same"] = (out / "index.json").read_bytes() == (
            local / "index.json"
        ).read_bytes()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
