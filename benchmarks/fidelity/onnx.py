"""Fidelity of the ONNX artefacts on the bundled Gemma 3 270M, on thirteen texts (issues 14, 21).

For each text of ``benchmarks/texts/`` (10 to 939 tokens, written for this benchmark) and the
three ``examples/`` (19 to 1074 tokens): compile (stable rule by default), then feed the query
alone to

- the torch patched model as the report measures it (``emitted``) and with its patched weights
  in fresh tensors (``torch_realloc``: the same numbers at other addresses, which take other CPU
  kernel paths, as a runtime does);
- one patchable ``patchable.onnx`` (exported once, from the first text's patch), run by
  onnxruntime with each text's ``.onnx_adapter`` active (``ort_adapter``), and without one:
  the unpatched model, whose distance from torch on the query (``ort_floor``) is onnxruntime's
  own floor; ``ort_check`` is the adapter against the torch patched model (the emitter's check),
  ``ort_own`` the adapter against onnxruntime's own full-context run (the user's runtime as the
  reference);
- with ``--baked N``: the baked ``model.onnx`` of the first N texts (each export takes minutes
  and about 8 GB of memory), its emitter check (onnxruntime vs torch patched, at the query and a
  16-token tail) beside.

Prints max |logit diff| against the full-context model and top-1 agreement, the unpatched control
beside, the largest rounding gain and output magnitude over blocks (MATH.md 12), and the worst of
each column; ``--json FILE`` writes the rows, ``--results FILE.md`` the table (stamped with the
commit and the date: ``testbed/tables.py``).

    python -m benchmarks.fidelity.onnx [--update stable] [--baked 13] [--json out.json]
        [--results docs/results/fidelity-onnx.md]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

import ctxc
from ctxc.backends.onnx.check import ort_session
from ctxc.backends.onnx.export import patched_logits
from ctxc.backends.onnx.model import emit_onnx
from ctxc.backends.onnx.ort_adapter import (
    emit_ort_adapter,
    load_adapter,
    run_adapter,
    write_adapter,
)
from ctxc.core.metrics import fidelity
from testbed.tables import invocation, write_table

TEXTS = Path(__file__).resolve().parents[1] / "texts"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _texts() -> list[Path]:
    """The ten benchmark texts, then the three examples."""
    examples = [EXAMPLES / f"{n}.txt" for n in ("short", "medium", "long")]
    return sorted(TEXTS.glob("*.txt")) + examples


def _fig(got: torch.Tensor, full: torch.Tensor) -> dict:
    f = fidelity(got, full)
    return {"max": f.max_abs_logit_diff, "top1": f.top1_match}


def _row(model, tok, path: Path, update: str) -> tuple[dict, object]:
    """Compile ``path``'s text; the torch columns of its row, and the compile result."""
    result = ctxc.compile(model, tok, context=path.read_text(), update=update)
    patch, rep, full = result.patch, result.report, result.full_logits
    q = torch.tensor([patch.meta.query_ids])
    row = {
        "text": path.stem,
        "tokens": len(patch.meta.context_ids),
        "control": {"max": rep.control.max_abs_logit_diff, "top1": rep.control.top1_match},
        "emitted": {"max": rep.emitted.max_abs_logit_diff, "top1": rep.emitted.top1_match},
        "torch_realloc": _fig(patched_logits(model, patch, [q])[0], full),
        "max_scale_change": max(b.max_scale_change or 0 for b in rep.blocks),
        "rounding_gain": max((b.rounding_gain or 0 for b in rep.blocks), default=0),
        "output_magnitude": max((b.output_magnitude or 0 for b in rep.blocks), default=0),
    }
    return row, result


def _ort_columns(row: dict, model, result, session, tmp: Path) -> None:
    """The onnxruntime columns: the adapter against the full context, against the torch patched
    model and against onnxruntime's own full-context run; the unpatched floor."""
    patch, full = result.patch, result.full_logits
    q = torch.tensor([patch.meta.query_ids])
    adapter_path = tmp / f"{row['text']}.onnx_adapter"
    write_adapter(patch, session, adapter_path)
    adapter = load_adapter(adapter_path, session)
    got = torch.from_numpy(run_adapter(session, adapter, q.numpy())[0])  # [k, vocab]
    row["ort_adapter"] = _fig(got, full)
    row["ort_check"] = float((got - patched_logits(model, patch, [q])[0]).abs().max())
    plain = torch.from_numpy(session.run(["logits"], {"input_ids": q.numpy()})[0][0])
    with torch.no_grad():
        unpatched = model(input_ids=q).logits[0].float()
    row["ort_floor"] = float((plain - unpatched).abs().max())
    ids = np.array([patch.meta.context_ids + patch.meta.query_ids], np.int64)
    own_full = torch.from_numpy(session.run(["logits"], {"input_ids": ids})[0][0, -len(q[0]) :])
    row["ort_own"] = _fig(got, own_full)
    row["ort_full_floor"] = float((own_full - full).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", default="stable")
    parser.add_argument("--baked", type=int, default=0, help="export model.onnx for N texts")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--results", type=Path, default=None, help="also write the table here (Markdown)"
    )
    args = parser.parse_args()
    model, tok = ctxc.load_model("gemma-3-270m", "float32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        session = None
        for i, path in enumerate(_texts()):
            row, result = _row(model, tok, path, args.update)
            patch, full = result.patch, result.full_logits
            if session is None:
                emit_ort_adapter(model, patch, Path(tmp), full=full, atol=float("inf"))
                session = ort_session(Path(tmp) / "patchable.onnx")
            _ort_columns(row, model, result, session, Path(tmp))
            if i < args.baked:
                q = torch.tensor([patch.meta.query_ids])
                out = Path(tmp) / f"baked-{path.stem}"
                file, figs = emit_onnx(model, patch, out, full=full, atol=float("inf"))
                got = ort_session(file).run(["logits"], {"input_ids": q.numpy()})[0][0]
                row["baked_onnx"] = _fig(torch.from_numpy(got), full)
                row["baked_check"] = [c.max_abs_diff for c in figs.checks]
                for f in out.iterdir():
                    f.unlink()
            rows.append(row)
            print(_line(row), flush=True)
    _worst(rows)
    if args.json:
        args.json.write_text(json.dumps({"update": args.update, "rows": rows}, indent=1) + "\n")
    if args.results is not None:
        write_table(
            args.results,
            "Fidelity of the ONNX artefacts: Gemma 3 270M, float32",
            invocation("benchmarks.fidelity.onnx"),
            _RESULT_HEADER,
            [_result_cells(r) for r in rows],
            _NOTES.format(update=args.update),
        )


_COLS = ("control", "emitted", "torch_realloc", "ort_adapter", "ort_own", "baked_onnx")


def _worst(rows: list[dict]) -> None:
    """Print each column's worst, and the floors'."""
    cols = [c for c in _COLS if any(c in r for r in rows)]
    worst = {c: max(r[c]["max"] for r in rows if c in r) for c in cols}
    top1 = {c: all(r[c]["top1"] for r in rows if c in r) for c in worst}
    print("worst: " + ", ".join(f"{c} {worst[c]:.3g} (top-1 all {top1[c]})" for c in worst))
    for c in ("ort_check", "ort_floor", "ort_full_floor", "rounding_gain"):
        print(f"worst {c}: {max(r[c] for r in rows):.3g}")


_RESULT_HEADER = (
    "text (tokens)",
    "control",
    "`model/` (emitted)",
    "torch, fresh tensors",
    "`.onnx_adapter`",
    "vs onnxruntime's own full context",
    "`model.onnx` baked (its check vs torch: query / 16 tok.)",
)

_NOTES = """\
Max |logit diff| at the query against the full-context model (plain Transformers), and top-1
agreement; update rule `{update}`. `torch, fresh tensors`: the patched weights copied into new
tensors (other addresses take other CPU kernel paths). `.onnx_adapter`: one `patchable.onnx`,
each text's adapter active in turn, in onnxruntime. The baked `model.onnx` is exported for the
first `--baked N` texts only (minutes and about 8 GB each).
"""


def _fig_cell(fig: dict | None) -> str:
    if fig is None:
        return "not run"
    return f"{fig['max']:.2g}, {'yes' if fig['top1'] else '**no**'}"


def _result_cells(row: dict) -> list[str]:
    """One row of the results table (``_RESULT_HEADER``)."""
    baked = _fig_cell(row.get("baked_onnx"))
    if "baked_check" in row:
        baked += " (" + " / ".join(f"{x:.2g}" for x in row["baked_check"]) + ")"
    return [
        f"{row['text']} ({row['tokens']})",
        _fig_cell(row["control"]),
        _fig_cell(row["emitted"]),
        _fig_cell(row["torch_realloc"]),
        _fig_cell(row["ort_adapter"]),
        _fig_cell(row["ort_own"]),
        baked,
    ]


def _line(row: dict) -> str:
    parts = [f"{row['text']:12} {row['tokens']:4d} tok."]
    for c in _COLS:
        if c in row:
            parts.append(f"{c} {row[c]['max']:.2e} {'yes' if row[c]['top1'] else 'NO'}")
    parts.append(f"check {row['ort_check']:.2e} floor {row['ort_floor']:.2e}")
    parts.append(f"full floor {row['ort_full_floor']:.2e}")
    if "baked_check" in row:
        parts.append("baked check " + "/".join(f"{x:.2e}" for x in row["baked_check"]))
    parts.append(f"max ds {row['max_scale_change']:.3g}")
    parts.append(f"rounding gain {row['rounding_gain']:.3g} x{row['output_magnitude']:.3g}")
    return "  ".join(parts)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
