"""Fidelity of the ONNX and PEFT artefacts on a real model (issue 5).

For each example context: compile, write ``model.onnx`` (patch baked) with the ONNX backend, open
it with a plain onnxruntime session, feed it the query ids alone and compare its last-position
logits with the original torch model fed context + query. Prints max and mean |logit diff|, total
variation and top-1 agreement, beside the emitter's own check (onnxruntime against the torch
patched model at two lengths) and the unpatched control. With ``--peft``, the same figures for the
PEFT adapter loaded with ``PeftModel.from_pretrained``, as loaded and merged; with
``--patchable``, for the patchable ONNX fed the patch through ``patch_feeds``.

    python -m benchmarks.fidelity.backends [--model M] [--texts short] [--update stable]
        [--peft] [--patchable]

Exporting Gemma 3 270M takes one to two minutes on two CPU cores and about 6 GB of memory.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

import ctxc
from ctxc.backends.onnx.model import emit_onnx
from ctxc.backends.onnx.patchable import emit_onnx_patchable, patch_feeds
from ctxc.backends.peft.adapter import emit_peft
from ctxc.backends.reference import reference_logits
from ctxc.core.metrics import Fidelity, fidelity

ROOT = Path(__file__).resolve().parents[2]


def _row(what: str, fid: Fidelity, extra: str = "") -> str:
    return (
        f"  {what:28} max {fid.max_abs_logit_diff:9.3g}  mean {fid.mean_abs_logit_diff:9.3g}  "
        f"TV {fid.total_variation:9.3g}  top-1 {'match' if fid.top1_match else 'MISMATCH':8} "
        f"{extra}"
    )


def _plain_ort(path: Path, query: list[int], feeds: dict | None = None) -> torch.Tensor:
    """Last-position logits [1, vocab] of ``model.onnx`` run by a fresh onnxruntime session."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.array([query], dtype=np.int64)
    logits = session.run(["logits"], {**(feeds or {}), "input_ids": ids})[0]
    return torch.from_numpy(logits[0, -1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--texts", nargs="+", default=["short"])
    parser.add_argument("--update", default="stable")
    parser.add_argument("--peft", action="store_true", help="also the PEFT adapter")
    parser.add_argument("--patchable", action="store_true", help="also the patchable ONNX")
    args = parser.parse_args()
    model, tok = ctxc.load_model(args.model, args.dtype)
    for name in args.texts:
        text = (ROOT / "examples" / f"{name}.txt").read_text()
        result = ctxc.compile(model, tok, context=text, update=args.update)
        rep, patch = result.report, result.patch
        full = reference_logits(model, patch)  # [k, vocab]
        print(
            f"{name}: {len(rep.context_ids)} context tokens, query {rep.query_ids}, "
            f"{args.update} rule, {args.dtype}"
        )
        print(_row("control (unpatched, query)", rep.control))
        print(_row("torch patched (report)", rep.emitted))
        with tempfile.TemporaryDirectory() as tmp:
            clock = time.perf_counter()
            path, figs = emit_onnx(model, patch, Path(tmp), full=full)
            took = time.perf_counter() - clock
            got = _plain_ort(path, rep.query_ids)
            checks = ", ".join(
                f"{c.max_abs_diff:.3g} (mean {c.mean_abs_diff:.3g}, {c.max_rel_diff:.3g} of "
                f"max |logit| {c.max_abs_logit:.3g}) at {c.length}"
                for c in figs.checks
            )
            print(
                _row(
                    "model.onnx, onnxruntime",
                    fidelity(got, full[-1:]),
                    f"(opset {figs.opset}, {figs.size_bytes / 1e9:.2f} GB, "
                    f"external data {figs.external_data}, {took:.0f} s)",
                )
            )
            print(f"  {'':28} emitter check, onnxruntime vs torch patched: max {checks} tokens")
            print(f"  {'':28} deltas inserted into the graph: {figs.deltas_inserted}")
        if args.patchable:
            with tempfile.TemporaryDirectory() as tmp:
                path, figs = emit_onnx_patchable(model, patch, Path(tmp), full=full)
                got = _plain_ort(path, rep.query_ids, patch_feeds(patch, path))
                print(_row("patchable model.onnx", fidelity(got, full[-1:])))
        if args.peft:
            with tempfile.TemporaryDirectory() as tmp:
                _, pf = emit_peft(model, patch, Path(tmp), full=full)
                loaded = pf.as_loaded_vs_patched.max_abs_logit_diff
                merged = pf.merged_vs_patched.max_abs_logit_diff
                print(_row("PEFT adapter, as loaded", pf.lora, f"vs patched {loaded:.3g}"))
                print(_row("PEFT adapter, merged", pf.merged, f"vs patched {merged:.3g}"))
                print(f"  note: {pf.note}")


if __name__ == "__main__":
    main()
