"""One onnxruntime session, 20 compiled contexts: switching ``.onnx_adapter`` files (issue 14).

Compiles 20 contexts on the bundled Gemma 3 270M (float32; the ten texts of
``benchmarks/texts/`` and the first half of each), exports one patchable ONNX (or takes
``--onnx``), writes one adapter per context, and in a single session runs each context's query
with its adapter active, in turn, twice round. Prints, per context, max |logit diff| against its
own full-context logits and the smallest against any other context's (a run that picked up the
wrong adapter would show there), then the costs: creating a session, loading an adapter, a run
with the same adapter as the run before, a run that switches adapter.

    python -m benchmarks.fidelity.ort_adapters [--onnx DIR/patchable.onnx] [--contexts 20]

Timings depend on the machine's load: on a shared machine, rerun them quietly.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import ctxc
from ctxc.backends.onnx.check import ort_session
from ctxc.backends.onnx.ort_adapter import (
    PATCHABLE_FILE,
    emit_ort_adapter,
    load_adapter,
    run_adapter,
    write_adapter,
)

TEXTS = Path(__file__).resolve().parents[1] / "texts"


def _contexts(n: int) -> list[tuple[str, str]]:
    texts = [(p.stem, p.read_text()) for p in sorted(TEXTS.glob("*.txt"))]
    halves = [(f"{name}-half", t[: len(t) // 2]) for name, t in texts]
    return (texts + halves)[:n]


def _timed(fn, repeat: int) -> float:
    """Median wall seconds of ``fn()``."""
    times = []
    for _ in range(repeat):
        clock = time.perf_counter()
        fn()
        times.append(time.perf_counter() - clock)
    return statistics.median(times)


def _check_switching(session, adapters: list, results: list) -> None:
    """Each context's query, its adapter active, in turn, twice round: its logits, printed."""
    fulls = [r.full_logits[-1] for _, r in results]
    worst_own, nearest_other = 0.0, float("inf")
    for round_ in range(2):
        for i, ((name, r), adapter) in enumerate(zip(results, adapters, strict=True)):
            q = np.array([r.patch.meta.query_ids], np.int64)
            got = torch.from_numpy(run_adapter(session, adapter, q)[0, -1])
            own = float((got - fulls[i]).abs().max())
            same_query = [
                j
                for j, (_, o) in enumerate(results)
                if j != i and o.patch.meta.query_ids == r.patch.meta.query_ids
            ]
            other = min(
                (float((got - fulls[j]).abs().max()) for j in same_query), default=float("inf")
            )
            worst_own, nearest_other = max(worst_own, own), min(nearest_other, other)
            top1 = "yes" if int(got.argmax()) == int(fulls[i].argmax()) else "NO"
            if round_ == 0:
                print(
                    f"{name:16} {len(r.patch.meta.context_ids):4d} tok.  own full context "
                    f"{own:.2e} top-1 {top1}  control {r.report.control.max_abs_logit_diff:.3g}"
                    f"  nearest other context with the same query {other:.3g}",
                    flush=True,
                )
    print(f"worst own {worst_own:.3g}; nearest other context {nearest_other:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnx", type=Path, default=None, help="an existing patchable ONNX")
    parser.add_argument("--contexts", type=int, default=20)
    args = parser.parse_args()
    model, tok = ctxc.load_model("gemma-3-270m", "float32")
    results = [
        (name, ctxc.compile(model, tok, context=text)) for name, text in _contexts(args.contexts)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        onnx = args.onnx
        if onnx is None:
            first = results[0][1]
            emit_ort_adapter(model, first.patch, Path(tmp), full=first.full_logits)
            onnx = Path(tmp) / PATCHABLE_FILE
        session = ort_session(onnx)
        adapters = []
        for name, r in results:
            path = Path(tmp) / f"{name}.onnx_adapter"
            write_adapter(r.patch, session, path)
            adapters.append(load_adapter(path, session))
        _check_switching(session, adapters, results)
        q = np.array([results[0][1].patch.meta.query_ids], np.int64)
        new_session = _timed(lambda: ort_session(onnx), 2)
        load = _timed(lambda: load_adapter(Path(tmp) / f"{results[0][0]}.onnx_adapter", session), 5)
        same = _timed(lambda: run_adapter(session, adapters[0], q), 10)
        cycle = iter(range(10**9))
        switch = _timed(lambda: run_adapter(session, adapters[next(cycle) % len(adapters)], q), 20)
        plain = _timed(lambda: session.run(["logits"], {"input_ids": q}), 10)
        print(
            f"session creation {new_session:.3f} s; adapter load (checked) {load * 1e3:.1f} ms; "
            f"run, same adapter {same * 1e3:.1f} ms; run, switching adapter {switch * 1e3:.1f} ms; "
            f"run, no adapter (zero defaults) {plain * 1e3:.1f} ms; ORT {ort.__version__}, "
            f"{torch.get_num_threads()} torch threads"
        )


if __name__ == "__main__":
    main()
