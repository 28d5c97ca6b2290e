"""The GPU check (issue 10): compile, ONNX export and the paper's table on one device.

For each dtype (float32, bfloat16 by default), on ``--device`` (default ``cuda``):

1. ``compile``: the model loaded there compiles ``--context``; prints the emitted model's
   max |logit diff| against the full context beside the unpatched control's, top-1, and the
   cost: compile time (a second compile: the first includes the export) over one plain forward
   pass of context + query (medians, CUDA synchronised);
2. ``onnx``: the patch baked into ``model.onnx`` (run by onnxruntime on the CPU against the
   torch patched model), its fidelity and the check's largest difference (``--no-onnx`` skips);
3. the paper's table (``benchmarks/fidelity/paper_table.py``'s five prompts x ``--steps``
   greedy steps x the standard and stable rules): token match, mean and max |logit diff|.

Each section prints one line, or ``FAILED: <first line of the error>`` and goes on: the script
is a check to run once on a machine with a GPU, and a failure is a finding.

    python -m benchmarks.fidelity.gpu_check [--device cuda] [--model M] [--steps 20] [--dtypes ...]
    python -m benchmarks.fidelity.gpu_check --device cpu --steps 2 --prompts 1    # anywhere
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import ctxc
from benchmarks.fidelity.paper_table import PROMPTS
from ctxc.generate.steps import generate

ROOT = Path(__file__).resolve().parents[2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int = 3) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_compile(model, tok, context: str, device: torch.device) -> tuple[str, object]:
    """The compile line, and the result (for the ONNX section)."""
    result = ctxc.compile(model, tok, context=context, device=str(device))  # traces once
    ids = torch.tensor([result.report.context_ids + result.report.query_ids], device=device)

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids)

    forward_s = _timed(forward, device)
    compile_s = _timed(lambda: ctxc.compile(model, tok, context=context), device, repeats=1)
    e, c = result.report.emitted, result.report.control
    line = (
        f"compile: max |logit diff| {e.max_abs_logit_diff:.3g} (control "
        f"{c.max_abs_logit_diff:.3g}), top-1 {e.top1_match}; {ids.shape[1]} tokens; compile "
        f"{compile_s:.3f} s / forward {forward_s:.4f} s = {compile_s / forward_s:.1f}x; "
        f"report device {result.report.device}"
    )
    return line, result


def check_onnx(model, result) -> str:
    """The ONNX line: export the compiled patch baked, check it with onnxruntime."""
    from ctxc.backends.onnx.model import emit_onnx

    with tempfile.TemporaryDirectory(prefix="ctxc-gpu-check-") as tmp:
        _, fig = emit_onnx(model, result.patch, Path(tmp), full=result.full_logits)
    worst = max(c.max_abs_diff for c in fig.checks)
    return (
        f"onnx: fidelity max |logit diff| {fig.fidelity.max_abs_logit_diff:.3g}, top-1 "
        f"{fig.fidelity.top1_match}; onnxruntime vs torch patched {worst:.3g} "
        f"(bound {fig.tolerance:g}); export {fig.export_seconds:.1f} s"
    )


def check_table(model, tok, steps: int, prompts: int) -> list[str]:
    """The paper's table rows for this model: one per update rule."""
    rows = []
    for update in ("standard", "stable"):
        found, start = [], time.perf_counter()
        for prompt in PROMPTS[:prompts]:
            found += generate(model, tok(prompt).input_ids, steps, update=update).steps
        diffs = [s.max_abs_logit_diff for s in found]
        rows.append(
            f"table {update:8}: match {sum(s.match for s in found)}/{len(found)}, mean diff "
            f"{statistics.mean(diffs):.3g}, max diff {max(diffs):.3g}, "
            f"{(time.perf_counter() - start) / len(found):.3f} s/step"
        )
    return rows


def _section(name: str, fn):
    try:
        return fn()
    except Exception as exc:  # a check reports every failure and goes on
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"{name}: FAILED: {type(exc).__name__}: {first}", flush=True)
        return None


def _one_dtype(args: argparse.Namespace, dtype: str, context: str) -> int:
    """The three sections for one dtype; how many failed."""
    print(f"== {dtype} ==", flush=True)
    model, tok = ctxc.load_model(args.model, dtype, device=args.device)
    device = next(model.parameters()).device
    failed = 0
    done = _section("compile", lambda: check_compile(model, tok, context, device))
    failed += done is None
    if done is not None:
        print(done[0], flush=True)
        if not args.no_onnx:
            line = _section("onnx", lambda: check_onnx(model, done[1]))
            failed += line is None
            if line:
                print(line, flush=True)
    rows = _section("table", lambda: check_table(model, tok, args.steps, args.prompts))
    failed += rows is None
    for row in rows or []:
        print(row, flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", default=str(ROOT / "examples" / "medium.txt"))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--no-onnx", action="store_true")
    args = parser.parse_args(argv)
    context = Path(args.context).read_text()
    print(f"torch {torch.__version__}, device {args.device}", flush=True)
    if torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()}", flush=True)
    failed = sum(_one_dtype(args, dtype, context) for dtype in args.dtypes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
