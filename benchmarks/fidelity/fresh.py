"""Fidelity of ``model/`` where the user runs it: a fresh process, plain Transformers (issue 21).

For each text: ``ctxc compile --model M --context TEXT --out DIR/NAME`` in a subprocess (the
folder and ``report.json`` a user gets), then a fresh Python process that never imports ctxc
loads ``DIR/NAME/model`` and the original model with plain ``AutoModelForCausalLM
.from_pretrained`` (every default: float32, the model's default attention, the cache on), feeds
``model/`` the query alone and the original context + query, and prints per text:

- ``report``: ``report.json``'s emitted max |logit diff|; ``fresh``: the same figure measured
  in the fresh process (and ``ratio``, report / fresh), its total variation and top-1;
- ``keep-k``: ``model/`` against the original's logits computed with ``logits_to_keep=k`` (the
  head over the query rows alone, as ``generate`` computes a prefill's logits);
- ``floor``: those two logits of the original against each other: what the runtime differs
  from itself by (``passes/runtime/plain_head.py``), the floor of any model fed the query alone;
- ``control``: the original fed the query alone, max |logit diff| and top-1;
- ``solver``: ``report.json``'s solver figure (ctxc's own arithmetic);
- for a ``.gguf`` model, ``gguf``: the original loaded from the file by Transformers'
  own GGUF loader against the folder ctxc converted it into (context + query; 0: the same
  weights, the same bits).

    python -m benchmarks.fidelity.fresh [--model M] [--texts NAME ...] [--out DIR]
        [--results docs/results/fidelity-torch.md]
    python -m benchmarks.fidelity.fresh --update lora --artefact lora \
        --results docs/results/fidelity-lora.md   # lora/ reloaded with plain PEFT (issue 23)
    python -m benchmarks.fidelity.llama_gguf /tmp/llama.gguf
    python -m benchmarks.fidelity.fresh --model /tmp/llama.gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from testbed.tables import invocation, write_table

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [ROOT / "examples" / f"{n}.txt" for n in ("short", "medium", "long")] + sorted(
    (ROOT / "benchmarks" / "texts").glob("*.txt")
)

# Run in a fresh interpreter with argv: OUT ORIGINAL [GGUF_FILE]. Plain Transformers only.
_CHECK = r"""
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM

out, base, artefact = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
rep = json.loads((out / "report.json").read_text())
ctx, q = rep["context_ids"], rep["query_ids"]
k = len(q)
orig = AutoModelForCausalLM.from_pretrained(base).eval()
if artefact == "lora":  # plain PEFT on a second copy of the original, as a server loads it
    from peft import PeftModel

    second = AutoModelForCausalLM.from_pretrained(base).eval()
    patched = PeftModel.from_pretrained(second, str(out / "lora")).eval()
else:
    patched = AutoModelForCausalLM.from_pretrained(str(out / "model")).eval()
full_ids, q_ids = torch.tensor([ctx + q]), torch.tensor([q])


def fig(a, b):
    a, b = a.double(), b.double()
    tv = 0.5 * (a.softmax(-1) - b.softmax(-1)).abs().sum(-1).max()
    top = bool((a.argmax(-1) == b.argmax(-1)).all())
    return {"max": float((a - b).abs().max()), "tv": float(tv), "top1": top}


with torch.no_grad():
    full = orig(full_ids).logits[0, -k:]
    keep = orig(full_ids, logits_to_keep=k).logits[0, -k:]
    got = patched(q_ids).logits[0]
    ctl = orig(q_ids).logits[0]
row = {
    "fresh": fig(got, full),
    "keep": fig(got, keep),
    "floor": fig(keep, full),
    "control": fig(ctl, full),
}
if len(sys.argv) > 4:
    gguf = Path(sys.argv[4])
    g = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name).eval()
    with torch.no_grad():
        row["gguf"] = fig(g(full_ids).logits[0, -k:], full)["max"]
print(json.dumps(row))
"""


def measure(model: str, text: Path, out: Path, update: str, artefact: str = "model") -> dict:
    """Compile ``text`` with the CLI, then check ``out/model`` (or ``out/lora`` with plain
    PEFT: ``artefact="lora"``) in a fresh process.

    Returns:
        the fresh process's figures, with ``report`` and ``solver`` from ``report.json``.
    """
    cmd = [
        sys.executable,
        "-m",
        "ctxc.cli.app",
        "compile",
        "--model",
        model,
        "--context",
        str(text),
    ]
    cmd += ["--update", update, "--out", str(out), "--force"]
    cmd += ["--emit", "lora"] if artefact == "lora" else []
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "?"}
    base, gguf = _original(model)
    args = [sys.executable, "-c", _CHECK, str(out), str(base), artefact]
    args += [str(gguf)] if gguf else []
    checked = subprocess.run(args, capture_output=True, text=True)
    if checked.returncode != 0:
        return {"error": checked.stderr.strip().splitlines()[-1]}
    row = json.loads(checked.stdout.strip().splitlines()[-1])
    rep = json.loads((out / "report.json").read_text())
    row["report"] = rep["emitted"]["max_abs_logit_diff"]
    row["solver"] = rep["solver"]["max_abs_logit_diff"]
    row["tokens"] = len(rep["context_ids"]) + len(rep["query_ids"])
    gaps = [(b["path"], b["reach_gap"]) for b in rep["blocks"] if b.get("reach_gap")]
    row["unreachable"] = ", ".join(f"{p.split('.')[-2]}: {g:.2g}" for p, g in gaps) or "none"
    return row


def _original(model: str) -> tuple[Path, Path | None]:
    """The folder plain Transformers loads the original from, and the GGUF file if any."""
    from ctxc.models.load import DEFAULT_MODEL, bundled_model_dir, converted_dir

    if model == DEFAULT_MODEL:
        return bundled_model_dir(), None
    path = Path(model)
    if path.suffix == ".gguf":
        return converted_dir(path.resolve()), path.resolve()
    return path, None


def _line(name: str, r: dict) -> str:
    if "error" in r:
        return f"{name:16} {r['error']}"
    f, c = r["fresh"], r["control"]
    ratio = r["report"] / f["max"] if f["max"] else float("nan")
    gguf = f" {r['gguf']:7.2g}" if "gguf" in r else ""
    return (
        f"{name:16} {r['tokens']:6d} {r['report']:9.3g} {f['max']:9.3g} {ratio:6.3f} "
        f"{f['tv']:8.2g} {'yes' if f['top1'] else 'NO':>4} {r['keep']['max']:9.3g} "
        f"{r['floor']['max']:9.3g} {c['max']:8.3g} {'yes' if c['top1'] else 'no':>4} "
        f"{r['solver']:9.3g}{gguf}"
    )


_HEADER = (
    "text",
    "tokens",
    "`report.json`",
    "fresh",
    "TV",
    "top-1",
    "keep-k",
    "floor",
    "control, top-1",
    "solver",
    "unreachable blocks (lora)",
)


def _cells(name: str, r: dict) -> list[str]:
    """One row of the results table (the columns of ``_HEADER``, then ``gguf`` if measured)."""
    if "error" in r:
        return [name, r["error"], *([""] * (len(_HEADER) - 2))]
    f, c = r["fresh"], r["control"]
    cells = [
        name,
        str(r["tokens"]),
        f"{r['report']:.3g}",
        f"{f['max']:.3g}",
        f"{f['tv']:.2g}",
        "yes" if f["top1"] else "**no**",
        f"{r['keep']['max']:.2g}",
        f"{r['floor']['max']:.3g}",
        f"{c['max']:.3g}, {'yes' if c['top1'] else 'no'}",
        f"{r['solver']:.2g}",
    ]
    cells.append(r["unreachable"])
    return [*cells, f"{r['gguf']:.2g}"] if "gguf" in r else cells


_NOTES = """\
Each text compiled by `ctxc compile` (update rule `{update}`, float32), then a fresh process
that never imports ctxc loads {artefact} and the original ({model}) with plain
`AutoModelForCausalLM.from_pretrained` and feeds the patched model the query alone. Max
|logit diff| at the query against: the default forward on context + query (`fresh`;
`report.json`'s figure beside it), the forward with `logits_to_keep=k` (`keep-k`); `floor`:
those two forwards of the original against each other; `control`: the original fed the query
alone; `solver`: ctxc's own pass; `unreachable blocks`: the lora rule's blocks whose target
was out of reach, with the distance left (MATH.md 10).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--texts", nargs="+", default=None, help="file stems (default: all 13)")
    parser.add_argument("--update", default="stable")
    parser.add_argument("--out", type=Path, default=None, help="keep the folders here")
    parser.add_argument(
        "--artefact",
        choices=("model", "lora"),
        default="model",
        help="model/ (plain Transformers) or lora/ (--emit lora, plain PEFT)",
    )
    parser.add_argument(
        "--results", type=Path, default=None, help="also write the table here (Markdown)"
    )
    args = parser.parse_args()
    texts = [t for t in TEXTS if args.texts is None or t.stem in args.texts]
    gguf = " gguf" if args.model.endswith(".gguf") else ""
    header = (
        f"{'text':16} {'tokens':>6} {'report':>9} {'fresh':>9} {'ratio':>6} {'TV':>8} "
        f"{'top1':>4} {'keep-k':>9} {'floor':>9} {'control':>8} {'top1':>4} {'solver':>9}{gguf}"
    )
    print(header)
    print("-" * len(header), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        for text in texts:
            row = measure(args.model, text, root / text.stem, args.update, args.artefact)
            rows.append(_cells(text.stem, row))
            print(_line(text.stem, row))
            sys.stdout.flush()
    if args.results is not None:
        columns = [*_HEADER, *(["gguf"] if gguf else [])]
        what = (
            "`lora/` with plain `PeftModel.from_pretrained`"
            if args.artefact == "lora"
            else "`model/`"
        )
        notes = _NOTES.format(update=args.update, model=args.model, artefact=what)
        write_table(
            args.results,
            f"Fidelity of `{args.artefact}/` in a fresh process: {args.model} ({args.update})",
            invocation("benchmarks.fidelity.fresh"),
            columns,
            [r + [""] * (len(columns) - len(r)) for r in rows],
            notes,
        )


if __name__ == "__main__":
    main()
