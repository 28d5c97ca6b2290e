"""A servable bake's LoRA where a server loads it: plain PEFT in a fresh process (issue 36).

For each rank R: ``ctxc bake --context PARAGRAPH --linear-only --rank R --emit
lora,safetensors-delta`` in a subprocess (what a user runs), then a fresh Python process that
never imports ctxc loads the original model with plain ``AutoModelForCausalLM.from_pretrained``
three times: as is (the unpatched control), with ``deltas.safetensors`` added to its weights as
the file's metadata says (``W = (W.float() + delta).to(W.dtype)``: ctxc's patched model, built
without ctxc), and with ``lora/`` loaded by ``PeftModel.from_pretrained`` (as loaded, and after
``merge_and_unload()``). Each is fed the paragraph's SQuAD questions alone (``BOS Question:
{q}\\nAnswer:``, the reading benchmark's query) and the served logits are compared with the
patched model's, at every position:

- ``peft``/``merged``: max |logit diff| from the patched model, and the bound ``ctxc bake``
  holds them to (``PEFT_RTOL`` times the largest logit, ``backends/peft/thresholds.py``);
- ``effect``: the unpatched model from the patched one (what an adapter that changed nothing
  would be off by);
- top-1 agreement at every position.

    python -m benchmarks.fidelity.fresh_bake [--paragraph Normans#0] [--ranks 16 64]
        [--results docs/results/fidelity-bake-lora.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.fidelity.fresh import _original
from testbed.tables import invocation, write_table

ROOT = Path(__file__).resolve().parents[2]
SUBSET = ROOT / "benchmarks" / "data" / "squad" / "subset.json"

NOTES = """Data: `benchmarks/data/squad/subset.json` (SQuAD v2.0 dev, CC BY-SA 4.0). Each rank:
`ctxc bake --context PARAGRAPH --linear-only --rank R --emit lora,safetensors-delta` (the default
fit data), then a fresh process (plain Transformers and PEFT, no ctxc) feeds the paragraph's
questions alone (`BOS Question: {q}\\nAnswer:`) to `lora/` loaded by `PeftModel.from_pretrained`
(as loaded, and merged) and to the original with `deltas.safetensors` added by the file's own
rule (ctxc's patched model, built without ctxc): max |logit diff| over every position of every
question. bound: the one `ctxc bake` holds `lora/` to (`PEFT_RTOL` times the largest logit);
unpatched vs patched: the figure an adapter that changed nothing would give."""

# Run in a fresh interpreter with argv: OUT ORIGINAL QUERIES_JSON. Plain Transformers and PEFT.
_CHECK = r"""
import json, sys
from pathlib import Path
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

out, base, queries = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
tok = AutoTokenizer.from_pretrained(base)
orig = AutoModelForCausalLM.from_pretrained(base).eval()
patched = AutoModelForCausalLM.from_pretrained(base).eval()
deltas = load_file(str(out / "deltas.safetensors"))
params = dict(patched.named_parameters())
with torch.no_grad():
    for name, delta in deltas.items():  # the file's own rule: W = (W.float() + delta).to(W.dtype)
        w = params[name]
        w.copy_((w.float() + delta).to(w.dtype))
served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(out / "lora"))
served = served.eval()
rows = []
with torch.no_grad():
    for q in queries:
        ids = tok(q, return_tensors="pt").input_ids
        want = patched(ids).logits[0].double()
        got = served(ids).logits[0].double()
        ctl = orig(ids).logits[0].double()
        rows.append({
            "tokens": ids.shape[1],
            "peft": float((got - want).abs().max()),
            "effect": float((ctl - want).abs().max()),
            "scale": float(want.abs().max()),
            "top1": int((got.argmax(-1) == want.argmax(-1)).sum()),
            "top1_control": int((ctl.argmax(-1) == want.argmax(-1)).sum()),
        })
    merged = served.merge_and_unload().eval()
    for q, row in zip(queries, rows):
        ids = tok(q, return_tensors="pt").input_ids
        want = patched(ids).logits[0].double()
        row["merged"] = float((merged(ids).logits[0].double() - want).abs().max())
print(json.dumps(rows))
"""


def measure(model: str, paragraph: dict, rank: int, out: Path) -> dict:
    """Bake ``paragraph`` linear-only at ``rank`` with the CLI, then check ``out/lora`` with
    plain PEFT in a fresh process against ``out/deltas.safetensors`` added by plain torch.

    Returns:
        the bake's seconds and the per-question figures, or ``error`` (the last stderr line).
    """
    from ctxc.backends.peft.thresholds import PEFT_RTOL

    context = out.parent / f"{out.name}.txt"
    context.write_text(paragraph["context"])
    cmd = [sys.executable, "-m", "ctxc.cli.app", "bake", "--model", model]
    cmd += ["--context", str(context), "--linear-only", "--rank", str(rank)]
    cmd += ["--emit", "lora,safetensors-delta", "--out", str(out), "--force"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "?"}
    base, _ = _original(model)
    queries = [f" Question: {q['question']}\nAnswer:" for q in paragraph["questions"]]
    args = [sys.executable, "-c", _CHECK, str(out), str(base), json.dumps(queries)]
    checked = subprocess.run(args, capture_output=True, text=True)
    if checked.returncode != 0:
        return {"error": checked.stderr.strip().splitlines()[-1]}
    rows = json.loads(checked.stdout.strip().splitlines()[-1])
    for row in rows:
        row["bound"] = PEFT_RTOL * max(1.0, row["scale"])
    return {"rank": rank, "questions": rows}


def _cells(result: dict) -> list[str]:
    rows = result["questions"]
    positions = sum(r["tokens"] for r in rows)
    worst = max(rows, key=lambda r: r["peft"] / r["bound"])
    return [
        str(result["rank"]),
        str(len(rows)),
        str(positions),
        f"{max(r['peft'] for r in rows):.3g}",
        f"{max(r['merged'] for r in rows):.3g}",
        f"{worst['bound']:.3g}",
        f"{min(r['effect'] for r in rows):.3g}-{max(r['effect'] for r in rows):.3g}",
        f"{sum(r['top1'] for r in rows)}/{positions}",
        f"{sum(r['top1_control'] for r in rows)}/{positions}",
        "yes" if all(r["peft"] <= r["bound"] and r["merged"] <= r["bound"] for r in rows) else "NO",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--paragraph", default="Normans#0", help="an id of the reading subset")
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--results", type=Path, default=None, help="write the Markdown page")
    args = parser.parse_args()
    subset = json.loads(SUBSET.read_text())["paragraphs"]
    (paragraph,) = [p for p in subset if p["id"] == args.paragraph]
    header = [
        "R", "questions", "positions", "PEFT as loaded vs patched", "merged vs patched",
        "bound", "unpatched vs patched", "top-1 = patched", "control top-1 = patched", "within",
    ]  # fmt: skip
    table, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        for rank in args.ranks:
            result = measure(args.model, paragraph, rank, Path(tmp) / f"r{rank}")
            if "error" in result:
                print(f"R={rank}: {result['error']}", file=sys.stderr)
                failed = True
                continue
            cells = _cells(result)
            failed |= cells[-1] != "yes"
            table.append(cells)
            print(" | ".join(cells), flush=True)
    if args.results:
        notes = f"Model: {args.model}, float32. Paragraph: {args.paragraph}. " + NOTES
        write_table(
            args.results,
            "A servable bake's LoRA in a fresh process (plain PEFT)",
            invocation("benchmarks.fidelity.fresh_bake"),
            header,
            table,
            notes,
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
