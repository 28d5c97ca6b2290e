"""What a compile costs, measured against one plain forward pass of the same input.

Compiling a context runs the model on the full input (context + query) once to record the
targets, solves every block's patch, runs the unpatched model on the query alone (the control)
and, with ``verify=True``, runs the patched model on the query once more. This script times:

* ``forward``: one plain forward pass ``model(input_ids=full_ids)`` under ``torch.no_grad``,
  where ``full_ids = report.context_ids + report.query_ids`` (median of ``--repeats``, after a
  warm-up run);
* ``compile, first``: the first ``ctxc.compile`` on the loaded model (``verify=True``);
* ``compile, verify=True`` and ``compile, verify=False``: later compiles (median of
  ``--repeats`` each);

and prints each in seconds and as a multiple of the forward pass, followed by the per-stage
``report.timings`` of each median run and the minor page faults of each measured run (memory
the kernel hands the process page by page: freshly allocated large buffers; a compile that
reuses its buffers takes few, docs/results/speed.md).

``--load N`` measures under contention: N other processes, each a one-thread loop of
1024 x 1024 float32 products, run beside every measurement (started before the model loads,
stopped at the end). The forward and the compile share the machine alike, so the question is
how much more the compile's ratio grows than the forward's (issue 33: at most 1.5x its quiet
ratio).

The first compile is slower because it includes ``torch.export`` of the model (the ``trace``
stage) and the search for patchable blocks. Both depend only on the model's architecture, not
on the context, and ``ctxc.compile`` caches them per model object (the exported graph reads the
model's own tensors), so the export is a one-time cost per loaded model: every later compile,
of any context, skips it. The ``compile, verify=...`` rows are the cost a user pays per context.

Usage::

    python -m benchmarks.cost.compile [--model SPEC] [--context FILE] [--repeats N] [--threads N]
                                      [--load N]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

import ctxc
from benchmarks.cost.contention import busy

ROOT = Path(__file__).resolve().parents[2]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="model spec for ctxc.load_model (default: bundled Gemma)"
    )
    parser.add_argument(
        "--context",
        type=Path,
        default=ROOT / "examples" / "medium.txt",
        help="context text file (default: examples/medium.txt)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per measurement (default: 3)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--load", type=int, default=0, help="busy processes beside the measurement (default: 0)"
    )
    args = parser.parse_args(argv)
    if args.load < 0:
        parser.error("--load must be at least 0")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    return args


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _time_compile(
    model, tokenizer, context: str, verify: bool
) -> tuple[float, ctxc.CompileResult, int]:
    faults, start = _faults(), time.perf_counter()
    result = ctxc.compile(model, tokenizer, context=context, verify=verify)
    return time.perf_counter() - start, result, _faults() - faults


def _median_compile(
    model, tokenizer, context: str, verify: bool, repeats: int
) -> tuple[float, dict[str, float], list[int]]:
    """Median seconds over ``repeats`` compiles, the timings of the median run, and each run's
    minor page faults."""
    runs = [_time_compile(model, tokenizer, context, verify) for _ in range(repeats)]
    faults = [run[2] for run in runs]
    runs.sort(key=lambda run: run[0])
    seconds, result, _ = runs[(len(runs) - 1) // 2]  # the lower median: an actual run
    return seconds, dict(result.report.timings), faults


def _time_forward(model, full_ids: torch.Tensor, repeats: int) -> tuple[float, list[int]]:
    with torch.no_grad():
        model(input_ids=full_ids)  # warm-up
        times, faults = [], []
        for _ in range(repeats):
            before, start = _faults(), time.perf_counter()
            model(input_ids=full_ids)
            times.append(time.perf_counter() - start)
            faults.append(_faults() - before)
    return statistics.median(times), faults


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with busy(args.load):
        return _measure(args)


def _measure(args: argparse.Namespace) -> int:
    context = args.context.read_text(encoding="utf-8")

    start = time.perf_counter()
    model, tokenizer = ctxc.load_model(args.model)
    load_s = time.perf_counter() - start

    first_s, first, _ = _time_compile(model, tokenizer, context, verify=True)
    report = first.report
    device = next(model.parameters()).device
    full_ids = torch.tensor(
        [report.context_ids + report.query_ids], dtype=torch.long, device=device
    )
    forward_s, forward_faults = _time_forward(model, full_ids, args.repeats)
    verified_s, verified_timings, verified_faults = _median_compile(
        model, tokenizer, context, True, args.repeats
    )
    unverified_s, unverified_timings, unverified_faults = _median_compile(
        model, tokenizer, context, False, args.repeats
    )

    print(
        f"model {report.model} ({report.dtype}), loaded in {load_s:.1f} s; "
        f"context {args.context.name}: {len(report.context_ids)} context + "
        f"{len(report.query_ids)} query tokens = {full_ids.shape[1]}; "
        f"{torch.get_num_threads()} threads, {args.repeats} repeats, device {device}"
        + (f"; {args.load} busy processes beside it" if args.load else "")
    )
    print()
    rows = [
        ("forward (full input)", forward_s),
        ("compile, first (verify=True)", first_s),
        ("compile, verify=True", verified_s),
        ("compile, verify=False", unverified_s),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'measurement':<{width}}  {'seconds':>9}  {'x forward':>9}")
    print(f"{'-' * width}  {'-' * 9}  {'-' * 9}")
    for name, seconds in rows:
        print(f"{name:<{width}}  {seconds:>9.3f}  {seconds / forward_s:>9.2f}")

    print()
    print("report.timings (seconds):")
    columns = [
        ("first", dict(report.timings)),
        ("verify=True", verified_timings),
        ("verify=False", unverified_timings),
    ]
    stages = list(dict.fromkeys(stage for _, t in columns for stage in t))
    stage_width = max(len("total"), *(len(stage) for stage in stages))
    print(f"{'stage':<{stage_width}}" + "".join(f"  {name:>12}" for name, _ in columns))
    for stage in [*stages, "total"]:
        cells = []
        for _, timings in columns:
            value = sum(timings.values()) if stage == "total" else timings.get(stage)
            cells.append(f"  {'-':>12}" if value is None else f"  {value:>12.3f}")
        print(f"{stage:<{stage_width}}" + "".join(cells))
    print()
    print("minor page faults per run:")
    print(f"  forward               {forward_faults}")
    print(f"  compile verify=True   {verified_faults}")
    print(f"  compile verify=False  {unverified_faults}")
    print()
    print(
        f"emitted max |logit diff| {report.emitted.max_abs_logit_diff:.3g} "
        f"(unpatched control {report.control.max_abs_logit_diff:.3g}), "
        f"top-1 {'match' if report.emitted.top1_match else 'MISMATCH'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
