"""Fidelity of the ONNX artefacts on the bundled Gemma 3 270M, on ten texts (issue 14).

For each text of ``benchmarks/texts/`` (10 to 939 tokens, written for this benchmark, not the
examples): compile (stable rule by default), then feed the query alone to

- the torch patched model as the report measures it (``emitted``) and with its patched weights
  in fresh tensors (``torch_realloc``: the same numbers at other addresses, which take other CPU
  kernel paths, as a runtime does);
- one patchable ``patchable.onnx`` (exported once, from the first text's patch), run by
  onnxruntime with each text's ``.onnx_adapter`` active (``ort_adapter``);
- with ``--baked N``: the baked ``model.onnx`` of the first N texts (each export takes minutes
  and about 8 GB of memory), its emitter check (onnxruntime vs torch patched, at the query and a
  16-token tail) beside.

Prints max |logit diff| against the full-context model and top-1 agreement, the unpatched control
beside, and the worst of each column; ``--json FILE`` writes the rows.

    python benchmarks/onnx_fidelity.py [--update stable] [--baked 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

import ctxc
from ctxc.backends.onnx_check import ort_session
from ctxc.backends.onnx_export import patched_logits
from ctxc.backends.onnx_model import emit_onnx
from ctxc.backends.ort_adapter import emit_ort_adapter, load_adapter, run_adapter, write_adapter
from ctxc.metrics import fidelity

TEXTS = Path(__file__).resolve().parent / "texts"


def _fig(got: torch.Tensor, full: torch.Tensor) -> dict:
    f = fidelity(got, full)
    return {"max": f.max_abs_logit_diff, "top1": f.top1_match}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", default="stable")
    parser.add_argument("--baked", type=int, default=0, help="export model.onnx for N texts")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model, tok = ctxc.load_model("gemma-3-270m", "float32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        session = None
        for i, path in enumerate(sorted(TEXTS.glob("*.txt"))):
            result = ctxc.compile(model, tok, context=path.read_text(), update=args.update)
            patch, rep, full = result.patch, result.report, result.full_logits
            q = torch.tensor([patch.meta.query_ids])
            row = {
                "text": path.stem,
                "tokens": len(patch.meta.context_ids),
                "control": {"max": rep.control.max_abs_logit_diff, "top1": rep.control.top1_match},
                "emitted": {"max": rep.emitted.max_abs_logit_diff, "top1": rep.emitted.top1_match},
                "torch_realloc": _fig(patched_logits(model, patch, [q])[0], full),
                "max_scale_change": max(b.max_scale_change or 0 for b in rep.blocks),
            }
            if session is None:
                emit_ort_adapter(model, patch, Path(tmp), full=full, atol=float("inf"))
                session = ort_session(Path(tmp) / "patchable.onnx")
            adapter_path = Path(tmp) / f"{path.stem}.onnx_adapter"
            write_adapter(patch, session, adapter_path)
            adapter = load_adapter(adapter_path, session)
            got = run_adapter(session, adapter, q.numpy())[0]
            row["ort_adapter"] = _fig(torch.from_numpy(got), full)
            if i < args.baked:
                out = Path(tmp) / f"baked-{path.stem}"
                file, figs = emit_onnx(model, patch, out, full=full, atol=float("inf"))
                got = ort_session(file).run(["logits"], {"input_ids": q.numpy()})[0][0]
                row["baked_onnx"] = _fig(torch.from_numpy(got), full)
                row["baked_check"] = [c.max_abs_diff for c in figs.checks]
                for f in out.iterdir():
                    f.unlink()
            rows.append(row)
            print(_line(row), flush=True)
    cols = ["control", "emitted", "torch_realloc", "ort_adapter", "baked_onnx"]
    worst = {c: max(r[c]["max"] for r in rows if c in r) for c in cols if any(c in r for r in rows)}
    top1 = {c: all(r[c]["top1"] for r in rows if c in r) for c in worst}
    print("worst: " + ", ".join(f"{c} {worst[c]:.3g} (top-1 all {top1[c]})" for c in worst))
    if args.json:
        args.json.write_text(json.dumps({"update": args.update, "rows": rows}, indent=1) + "\n")


def _line(row: dict) -> str:
    parts = [f"{row['text']:12} {row['tokens']:4d} tok."]
    for c in ("control", "emitted", "torch_realloc", "ort_adapter", "baked_onnx"):
        if c in row:
            parts.append(f"{c} {row[c]['max']:.2e} {'yes' if row[c]['top1'] else 'NO'}")
    if "baked_check" in row:
        parts.append("check " + "/".join(f"{x:.2e}" for x in row["baked_check"]))
    parts.append(f"max ds {row['max_scale_change']:.3g}")
    return "  ".join(parts)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
