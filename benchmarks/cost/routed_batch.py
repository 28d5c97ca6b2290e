"""A routed bake's chunks in one process, in worker processes, interrupted and resumed, and on
Ray (issue 55): the same patches, byte for byte, and the wall time of each.

Runs of ``ctxc --threads T bake --route`` over one document, each a new process, every one at
the same threads per chunk (``--threads T`` split between ``--workers N``: give ``T = 1``, or
``T = N``, for the comparison to hold):

* ``one``: ``--workers 1``, every chunk in the command's process;
* ``workers``: ``--workers N`` local worker processes;
* ``resumed``: the same, interrupted (SIGINT to the command) once ``--interrupt-after`` chunks
  are in ``DIR/chunks/``, then rerun with ``--resume``: the chunks kept must not be baked again
  (their patch files untouched);
* ``ray``: ``--engine ray --workers N`` on a local Ray the command starts itself.

Each run's ``chunks/<id>/patch.safetensors`` are compared by SHA-256 with ``one``'s, and its
reports but their wall times.

    python -m benchmarks.cost.routed_batch [--doc FILE] [--chunk-words 100] [--workers 2]
        [--threads 1] [--model SPEC] [--fit "ARGS"] [--interrupt-after 1] [--skip-ray]
        [--keep DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "benchmarks" / "data" / "document.txt"


def digests(out: Path) -> dict[str, str]:
    """SHA-256 of each chunk's patch.safetensors, by chunk id."""
    return {
        p.parent.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((out / "chunks").glob("*/patch.safetensors"))
    }


def reports(out: Path) -> dict[str, dict]:
    """Each chunk's report.json without its wall times."""
    got = {}
    for path in sorted((out / "chunks").glob("*/report.json")):
        report = json.loads(path.read_text())
        report.pop("timings", None)
        got[path.parent.name] = report
    return got


def finished(out: Path) -> list[str]:
    """The chunk folders in place (not staging)."""
    if not (out / "chunks").is_dir():
        return []
    return sorted(p.name for p in (out / "chunks").iterdir() if not p.name.startswith("."))


def run(cmd: list[str], stop_after: tuple[Path, int] | None = None) -> tuple[float, int, str]:
    """(wall seconds, exit status, stderr) of ``cmd``; SIGINT once ``stop_after``'s folder
    holds that many finished chunks."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if stop_after is not None:
        out, k = stop_after
        while proc.poll() is None and len(finished(out)) < k:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    err = proc.communicate()[1]
    return time.perf_counter() - start, proc.returncode, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--chunk-words", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--fit", default="", help="more bake options, one string")
    ap.add_argument("--interrupt-after", type=int, default=1)
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--keep", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="ctxc-routed-"))
    work.mkdir(parents=True, exist_ok=True)
    model = ["--model", args.model] if args.model else []
    head = [sys.executable, "-m", "ctxc.cli.app", "--threads", str(args.threads), "bake"]
    bake = [*head, *model, *shlex.split(args.fit), "--route", "--context", str(args.doc)]
    bake += ["--chunk-words", str(args.chunk_words)]
    wide = ["--workers", str(args.workers)]
    result: dict = {"doc": str(args.doc), "workers": args.workers, "threads": args.threads}

    def step(label: str, out: Path, extra: list[str], stop=None, expect: int = 0) -> None:
        seconds, rc, err = run([*bake, "--out", str(out), *extra], stop)
        if rc != expect:
            sys.exit(f"{label}: exit {rc}, expected {expect}\n{err[-3000:]}")
        print(f"{label:<12} {seconds:7.1f} s", flush=True)
        result[f"{label} s"] = round(seconds, 1)

    one = work / "one"
    step("one", one, ["--workers", "1"])
    result["chunks"] = len(digests(one))
    result["sha256"] = digests(one)
    runs = {"workers": work / "workers", "resumed": work / "resumed"}
    step("workers", runs["workers"], wide)
    out = runs["resumed"]
    step("interrupted", out, wide, (out, args.interrupt_after), expect=130)

    def stamp(chunk: str) -> int:
        return (out / "chunks" / chunk / "patch.safetensors").stat().st_mtime_ns

    kept = {c: stamp(c) for c in finished(out)}
    step("resume", out, [*wide, "--resume"])
    result["interrupted kept"] = sorted(kept)
    result["rebaked of kept"] = sorted(c for c, t in kept.items() if stamp(c) != t)
    if not args.skip_ray:
        runs["ray"] = work / "ray"
        step("ray", runs["ray"], [*wide, "--engine", "ray"])
    for label, folder in runs.items():
        result[f"{label} patches same"] = digests(folder) == digests(one)
        result[f"{label} reports same"] = reports(folder) == reports(one)
        result[f"{label} router same"] = (folder / "router.json").read_bytes() == (
            one / "router.json"
        ).read_bytes()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
