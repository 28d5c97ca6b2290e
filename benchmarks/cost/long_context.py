"""Long contexts: what a compile costs against one plain forward pass, from 1k to 32k tokens.

For each length ``n`` it runs, each in a fresh subprocess (so one run's peak cannot hide
another's):

* ``forward``: the loaded model fed the ``n`` tokens once, ``model(input_ids, use_cache=False,
  logits_to_keep=1)`` under ``torch.no_grad`` (the decoder on every position, the head on the
  last one only: Gemma's 262k vocabulary makes full logits at 32k tokens alone 34 GB);
* ``compile``: ``ctxc.compile(model, context_ids=ids)`` of the same ``n`` tokens (the query is
  the last one), with the verification (``verify=True``), on a model whose export is already
  made (``torch.export`` is a one-time cost per loaded model, timed apart as ``trace``).

Both load the model first, copy its weights into anonymous memory (as loaded they are pages of
the mapped safetensors file, which the kernel drops and reads again under memory pressure: a
peak would then depend on the other processes) and warm up on 16 tokens; the peak resident
memory (``VmHWM``) is then reset (``/proc/self/clear_refs``), so a peak is that of the run
alone, the loaded model included. The parent polls each child's resident memory and kills it
past ``--limit-gib``. It prints time and peak ratios (compile / forward), the fidelity of the
emitted model fed the query alone (max |logit diff| against the full context, top-1) beside the
unpatched control, and how far the compile's full-run logits are from the plain forward's.

The texts are the examples (``examples/*.txt``), their paragraphs in a seeded order, repeated
until the length is reached: nothing is downloaded.

Usage::

    python -m benchmarks.cost.long_context [--lengths 1024 2048 4096 8192 32768] [--threads N]
        [--limit-gib 14] [--model SPEC] [--json FILE]

Time ratios need a quiet machine (other processes on the cores distort them); memory ratios
do not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import ctxc

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = (1024, 2048, 4096, 8192, 32768)
_GIB = 1024**3


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--model", default=None, help="model spec (default: bundled Gemma)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--limit-gib", type=float, default=14.0, help="kill a run past this RSS")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--forward-max",
        type=int,
        default=None,
        help="no plain forward above this length (it reads all n^2 scores of every layer: "
        "hours at 32k on 2 loaded cores); the compile still runs",
    )
    parser.add_argument("--child", choices=("forward", "compile"), help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--reference", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _status(pid: int | str, key: str) -> int:
    """A ``/proc/<pid>/status`` memory line in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def long_ids(tokenizer, n: int, seed: int = 0) -> list[int]:
    """``n`` token ids: the examples' paragraphs in a seeded order, repeated, BOS first."""
    paragraphs = []
    for path in sorted((ROOT / "examples").glob("*.txt")):
        paragraphs += [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n")]
    paragraphs = [p for p in paragraphs if p]
    rng = random.Random(seed)
    ids = tokenizer("")["input_ids"]  # the model's usual special tokens (BOS)
    while len(ids) < n:
        rng.shuffle(paragraphs)
        ids += tokenizer("\n\n".join(paragraphs) + "\n\n", add_special_tokens=False)["input_ids"]
    return ids[:n]


def _child(args: argparse.Namespace) -> None:
    """One measured run in this process; its figures go to ``args.out`` as JSON."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = ctxc.load_model(args.model)
    with torch.no_grad():  # weights in anonymous memory (see the module's docstring)
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
    ids = long_ids(tokenizer, args.length)
    row: dict = {"n": args.length, "threads": torch.get_num_threads()}
    warm = ids[:16]
    if args.child == "forward":
        run = _forward_run(model)
        run(warm)
    else:
        start = time.perf_counter()
        ctxc.compile(model, context_ids=warm)  # the export (once per model) and a warm-up
        row["trace_s"] = time.perf_counter() - start
        run = _compile_run(model, row, args.reference)
    row["loaded_bytes"] = _status("self", "VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    start = time.perf_counter()
    logits = run(ids)
    row["seconds"] = time.perf_counter() - start
    row["peak_bytes"] = _status("self", "VmHWM")
    if args.child == "forward":
        save_file({"logits": logits}, str(args.reference))
    args.out.write_text(json.dumps(row))


def _forward_run(model):
    def run(these: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([these]), use_cache=False, logits_to_keep=1)
        return out.logits[0, -1].float()  # [vocab]

    return run


def _compile_run(model, row: dict, reference: Path | None):
    def run(these: list[int]) -> torch.Tensor:
        result = ctxc.compile(model, context_ids=these)
        report = result.report
        row["timings"] = dict(report.timings)
        row["emitted"] = report.emitted.max_abs_logit_diff
        row["top1"] = report.emitted.top1_match
        row["control"] = report.control.max_abs_logit_diff
        row["control_top1"] = report.control.top1_match
        if reference is not None and reference.is_file():
            want = load_file(str(reference))["logits"]  # [vocab]
            row["full_vs_forward"] = float((result.full_logits[-1] - want).abs().max())
        return result.full_logits[-1]

    return run


def _spawn(mode: str, n: int, args: argparse.Namespace, tmp: Path) -> dict:
    """Run one child, polling its memory; its row, or ``{"error": ...}``."""
    out = tmp / f"{mode}-{n}.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.cost.long_context",
        "--child",
        mode,
        "--length",
        str(n),
        "--out",
        str(out),
    ]
    cmd += ["--reference", str(tmp / f"logits-{n}.safetensors")]
    if args.model:
        cmd += ["--model", args.model]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    seen = 0
    while proc.poll() is None:
        with contextlib.suppress(OSError, KeyError):
            seen = max(seen, _status(proc.pid, "VmRSS"))
        if seen > args.limit_gib * _GIB:
            proc.kill()
            proc.wait()
            return {"error": f"killed at {seen / _GIB:.1f} GiB RSS (--limit-gib)"}
        time.sleep(0.2)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0 or not out.is_file():
        tail = err.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"error": tail[0][:200]}
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.child:
        _child(args)
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="ctxc-long-") as name:
        tmp = Path(name)
        for n in args.lengths:
            skip = args.forward_max is not None and n > args.forward_max
            forward = (
                {"error": "not run (--forward-max)"} if skip else _spawn("forward", n, args, tmp)
            )
            compiled = _spawn("compile", n, args, tmp)
            rows.append({"n": n, "forward": forward, "compile": compiled})
            _print_row(rows[-1], header=len(rows) == 1)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def _print_row(row: dict, header: bool) -> None:
    if header:
        print(
            f"{'tokens':>6} {'fwd s':>7} {'compile s':>9} {'time x':>6} {'fwd GiB':>7} "
            f"{'cmp GiB':>7} {'peak x':>6} {'emitted':>8} {'top1':>4} {'control':>7} "
            f"{'full-fwd':>8} {'trace s':>7}",
            flush=True,
        )
    f, c = row["forward"], row["compile"]
    if "error" in f and "error" not in c:
        print(
            f"{row['n']:>6} {'-':>7} {c['seconds']:>9.2f} {'-':>6} {'-':>7} "
            f"{c['peak_bytes'] / _GIB:>7.2f} {'-':>6} {c['emitted']:>8.2g} "
            f"{'yes' if c['top1'] else 'no':>4} {c['control']:>7.3g} {'-':>8} "
            f"{c['trace_s']:>7.1f}  (forward: {f['error']})",
            flush=True,
        )
        print(f"       compile stages (s): {c['timings']}", flush=True)
        return
    if "error" in f or "error" in c:
        print(f"{row['n']:>6} forward: {f.get('error', 'ok')}; compile: {c.get('error', 'ok')}")
        return
    print(
        f"{row['n']:>6} {f['seconds']:>7.2f} {c['seconds']:>9.2f} "
        f"{c['seconds'] / f['seconds']:>6.2f} {f['peak_bytes'] / _GIB:>7.2f} "
        f"{c['peak_bytes'] / _GIB:>7.2f} {c['peak_bytes'] / f['peak_bytes']:>6.2f} "
        f"{c['emitted']:>8.2g} {'yes' if c['top1'] else 'no':>4} {c['control']:>7.3g} "
        f"{c.get('full_vs_forward', float('nan')):>8.2g} {c['trace_s']:>7.1f}",
        flush=True,
    )
    print(f"       compile stages (s): {c['timings']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
