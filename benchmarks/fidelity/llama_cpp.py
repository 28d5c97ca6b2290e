"""ctxc's GGUF artefacts run in llama.cpp itself, on thirteen texts (issue 21, check 2).

For each text (examples/{short,medium,long}.txt and benchmarks/texts/*.txt) and the bundled
Gemma 3 270M: compile with ``--update`` (default ``stable``), write the patched ``model.gguf``
(F32) and run it in llama.cpp fed the query alone, against llama.cpp's own full-context run on
the unpatched F32 GGUF; then compile with the ``lora`` rule, write ``lora.gguf`` and run it on
the unpatched F32 GGUF and on the bundled Q4_K_M file (what llama.cpp users run), each against
llama.cpp's full-context run on that same base. Beside each: llama.cpp's own floor (the
unpatched GGUF fed the query alone, llama.cpp vs Transformers), llama.cpp vs Transformers on
context + query (``full-vs-T``), the bound ctxc's check uses (``2 x max(floor, full-vs-T) + own``,
``own``: the torch patched model's distance from the plain full-context forward), and the
control (the unpatched GGUF fed the query alone vs the full-context run).

``model.gguf`` is written with ``write_gguf`` directly: the Transformers-side GGUF check
(``GGUF_ATOL``) is not applied here, so texts it refuses are measured too.

    pip install ".[llamacpp]" && bash tools/llamacpp/install.sh .venv/bin/python  # glibc < 2.38
    python -m benchmarks.fidelity.llama_cpp [--model M] [--texts short 01_greeting ...]
        [--update stable] [--no-lora] [--json FILE] [--results docs/results/fidelity-llama-cpp.md]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

import ctxc
from ctxc.backends.gguf.llama_cpp.run import (
    LLAMA_CPP_FACTOR,
    LlamaCppFigures,
    llama_cpp_check,
    llama_cpp_unavailable,
)
from ctxc.backends.gguf.lora import write_gguf_lora
from ctxc.backends.gguf.write import write_gguf
from ctxc.backends.reference import reference_logits, torch_logits
from ctxc.core.metrics import fidelity
from ctxc.models.load import source_gguf
from testbed.tables import invocation, write_table

ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["short", "medium", "long", *sorted(p.stem for p in (ROOT / "benchmarks/texts").glob("*"))]


def _text(name: str) -> str:
    path = ROOT / "examples" / f"{name}.txt"
    return (path if path.is_file() else ROOT / "benchmarks" / "texts" / f"{name}.txt").read_text()


def _cell(f: LlamaCppFigures) -> dict:
    bound = LLAMA_CPP_FACTOR * max(f.floor, f.full_vs_transformers) + f.own
    return {
        "patched": f.patched.max_abs_logit_diff,
        "tv": f.patched.total_variation,
        "top1": f.patched.top1_match,
        "floor": f.floor,
        "own": f.own,
        "bound": bound,
        "passes": f.patched.max_abs_logit_diff <= bound,
        "control": f.control.max_abs_logit_diff,
        "full_vs_transformers": f.full_vs_transformers,
    }


def _measure(model, tok, patch, runtime_file: Path, base: Path, *, lora: bool, q4: Path | None):
    """llama.cpp figures of one artefact: on ``base`` and, for a LoRA, on ``q4`` too."""
    ids = (list(patch.meta.context_ids), list(patch.meta.query_ids))
    full = reference_logits(model, patch)  # plain forward, context + query
    (alone,) = torch_logits(model, [torch.tensor([ids[1]])])
    with patch.applied(model, check=False):
        (patched,) = torch_logits(model, [torch.tensor([ids[1]])])
    common = {
        "ids": ids,
        "transformers_query": alone,
        "transformers_full": full,
        "own": fidelity(patched, full).max_abs_logit_diff,
        "enforce": False,
    }
    kind = {"lora": runtime_file} if lora else {"patched": runtime_file}
    cells = {
        "F32": _cell(llama_cpp_check(runtime_file.name, base, base_name="F32", **kind, **common))
    }
    if lora and q4 is not None:
        cells["Q4_K_M"] = _cell(
            llama_cpp_check("lora.gguf", q4, lora=runtime_file, base_name="Q4_K_M", **common)
        )
    return cells


def _row(name: str, tokens: int, what: str, base: str, c: dict) -> str:
    return (
        f"{name:12} {tokens:6d} {what:10} {base:6} {c['patched']:9.3g} {c['floor']:9.3g} "
        f"{c['own']:9.3g} {c['bound']:9.3g} {'yes' if c['passes'] else 'NO':>4} "
        f"{c['control']:9.3g} {c['full_vs_transformers']:9.3g} {c['tv']:8.2g} "
        f"{'match' if c['top1'] else 'MISS':>5}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--texts", nargs="+", default=TEXTS)
    parser.add_argument("--update", default="stable", help="the model.gguf rows' rule")
    parser.add_argument("--no-lora", action="store_true", help="skip the lora rule's rows")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--results", type=Path, default=None, help="also write the table here (Markdown)"
    )
    args = parser.parse_args()
    reason = llama_cpp_unavailable()
    if reason is not None:
        raise SystemExit(f"llama.cpp cannot run: {reason}")
    hf_logging.disable_progress_bar()
    model, tok = ctxc.load_model(args.model)
    q4 = source_gguf(model)
    header = (
        f"{'text':12} {'tokens':>6} {'artefact':10} {'base':6} {'llama.cpp':>9} {'floor':>9} "
        f"{'own':>9} {'bound':>9} {'ok':>4} {'control':>9} {'full-vs-T':>9} {'TV':>8} {'top1':>5}"
    )
    print(header)
    print("-" * len(header), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ctxc-llama-bench-") as tmp:
        base = Path(tmp) / "base.gguf"
        write_gguf(model, tok, base)
        for name in args.texts:
            text = _text(name)
            result = ctxc.compile(model, tok, context=text, update=args.update)
            tokens = len(result.patch.meta.context_ids) + len(result.patch.meta.query_ids)
            path = Path(tmp) / "model.gguf"
            with result.patch.applied(model, check=False):
                write_gguf(model, tok, path)
            cells = {
                "model.gguf": _measure(model, tok, result.patch, path, base, lora=False, q4=None)
            }
            path.unlink()
            if not args.no_lora:
                lora = ctxc.compile(model, tok, context=text, update="lora").patch
                path = Path(tmp) / "lora.gguf"
                write_gguf_lora(model, lora, path)
                cells["lora.gguf"] = _measure(model, tok, lora, path, base, lora=True, q4=q4)
            for what, by_base in cells.items():
                for base_name, c in by_base.items():
                    print(_row(name, tokens, what, base_name, c), flush=True)
                    rows.append(
                        {"text": name, "tokens": tokens, "artefact": what, "base": base_name, **c}
                    )
    if args.json is not None:
        args.json.write_text(json.dumps({"update": args.update, "rows": rows}, indent=1) + "\n")
    if args.results is not None:
        write_table(
            args.results,
            "GGUF artefacts run in llama.cpp",
            invocation("benchmarks.fidelity.llama_cpp"),
            _result_header(args.update),
            _result_rows(rows),
            _NOTES,
        )


_NOTES = """\
Max |logit diff| at the query (the last context token), llama.cpp fed the query alone against
llama.cpp's own full-context run on the same base. `floor`: llama.cpp against Transformers on the
unpatched model fed the query alone; `full-vs-T`: the same on context + query; `bound`: the
check's `2 x max(floor, full-vs-T) + own` for `model.gguf`; bold: over the bound (refused by
`--emit gguf`). `lora.gguf` (lora rule): on the F32 base (its `own` figure in brackets) and on the
bundled Q4_K_M file (its floor in brackets; reported, not checked). `control`: the unpatched GGUF
fed the query alone.
"""


def _result_header(update: str) -> list[str]:
    return [
        "text (tokens)",
        f"model.gguf, {update}",
        "floor",
        "full-vs-T",
        "bound",
        "lora.gguf on F32 (own)",
        "lora.gguf on Q4_K_M (its floor)",
        "control",
    ]


def _result_rows(rows: list[dict]) -> list[list[str]]:
    """One line per text from the rows per (text, artefact, base)."""
    by_text: dict[str, dict] = {}
    for r in rows:
        by_text.setdefault(r["text"], {})[(r["artefact"], r["base"])] = r
    out = []
    for text, cells in by_text.items():
        m = cells[("model.gguf", "F32")]
        figure = f"{m['patched']:.3g}"
        lora, q4 = cells.get(("lora.gguf", "F32")), cells.get(("lora.gguf", "Q4_K_M"))
        out.append(
            [
                f"{text} ({m['tokens']})",
                figure if m["passes"] else f"**{figure}**",
                f"{m['floor']:.3g}",
                f"{m['full_vs_transformers']:.2g}",
                f"{m['bound']:.3g}",
                "-" if lora is None else f"{lora['patched']:.3g} ({lora['own']:.2g})",
                "-" if q4 is None else f"{q4['patched']:.3g} ({q4['floor']:.3g})",
                f"{m['control']:.3g}",
            ]
        )
    return out


if __name__ == "__main__":
    main()
