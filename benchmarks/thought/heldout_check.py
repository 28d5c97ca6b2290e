"""An independent held-out check of ``ctxc bake`` (issue 35): fresh samples as a user draws them.

``ctxc bake``'s report measures its patch on held-out samples it draws itself. This check draws
its own, the way a user would, and measures in the plain runtime: for each context

1. ``ctxc bake --context FILE --out DIR`` runs as a new process with its defaults (the
   patched model written as ``DIR/model/``, its own held-out figure in ``DIR/report.json``);
2. the original model (Transformers, its defaults) samples ``--samples`` continuations of
   ``--tokens`` tokens after the context with ``generate(do_sample=True, top_k=0, top_p=1.0,
   temperature=1.0)`` (the model's own distribution), seeded;
3. per sampled token, KL(full || patched): the original fed context + sample against the baked
   ``DIR/model/`` fed BOS + sample (the bake's query form), and the unpatched control: the
   original fed BOS + sample. Mean over every sampled token.

It passes when the baked KL is below the unpatched model's on every context and the bake's own
held-out figure is within ``--within`` (20%) of this one. Exit 1 otherwise (the table printed
either way).

    python -m benchmarks.thought.heldout_check [--contexts factsheet,persona,document]
        [--samples 8] [--tokens 24] [--seed 1234] [--keep DIR] [--json FILE] [-- BAKE ARGS]
    python -m benchmarks.thought.heldout_check --render FILE > docs/results/heldout_check.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from testbed.tables import commit, invocation

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "data"


def sample(model, context_ids: list[int], count: int, tokens: int, seed: int) -> list[list[int]]:
    """``count`` continuations of ``tokens`` tokens drawn by ``generate`` from the model's own
    distribution after the context (one batch: the same context on every row)."""
    torch.manual_seed(seed)
    ids = torch.tensor([context_ids] * count)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=model.config.eos_token_id if model.config.pad_token_id is None else None,
        )
    return [row[len(context_ids) :].tolist() for row in out]


def logits_at(model, prefix: list[int], sample_ids: list[int]) -> torch.Tensor:
    """The logits predicting each sampled token [len(sample), vocab], float32: the last
    position of ``prefix`` and every sampled token's but the last."""
    ids = torch.tensor([prefix + sample_ids[:-1]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    return logits[len(prefix) - 1 :].float()


def measure(name: str, text: Path, args, bake_args: list[str], work: Path) -> dict:
    """Bake ``text`` in a new process, then the three-way KL on fresh samples; the row."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ctxc.bake.data import special_prefix
    from ctxc.bake.evaluate import position_figures
    from ctxc.models.load import model_directory

    out = work / name
    cmd = [sys.executable, "-m", "ctxc.cli.app", "bake", "--context", str(text), "--out"]
    cmd += [str(out), "--force", *(["--model", args.model] if args.model else []), *bake_args]
    clock = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - clock
    own = json.loads((out / "report.json").read_text())["figures"]["held_out_samples"]
    folder = model_directory(args.model)
    tok = AutoTokenizer.from_pretrained(folder)
    original = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    baked = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    context = tok(text.read_text(encoding="utf-8")).input_ids
    bos = special_prefix(tok)  # what the bake's queries start with (Gemma: BOS)
    drawn = sample(original, context, args.samples, args.tokens, args.seed)
    kl_baked, kl_none, top_baked, top_none = [], [], [], []
    for s in drawn:
        full = logits_at(original, context, s)  # [T, vocab]
        for kls, tops, other in ((kl_baked, top_baked, logits_at(baked, bos, s)),
                                 (kl_none, top_none, logits_at(original, bos, s))):  # fmt: skip
            kl, agree = position_figures(other, full)  # KL(full || other) [T], float64
            kls.append(kl)
            tops.append(agree.double())
    kb, kn = torch.cat(kl_baked), torch.cat(kl_none)
    row = {
        "context": name,
        "tokens": len(context),
        "bake_seconds": round(seconds, 1),
        "kl_baked": float(kb.mean()),
        "kl_unpatched": float(kn.mean()),
        "top1_baked": float(torch.cat(top_baked).mean()),
        "top1_unpatched": float(torch.cat(top_none).mean()),
        "own_kl_baked": own["patched"]["kl"],
        "own_kl_unpatched": own["control"]["kl"],
        # KL by position in the sample: where a patch fitted on short samples stops helping
        "kl_baked_by_position": torch.stack(kl_baked).mean(0).tolist(),
        "kl_unpatched_by_position": torch.stack(kl_none).mean(0).tolist(),
    }
    row["own_over_independent"] = row["own_kl_baked"] / row["kl_baked"]
    return row


def render(doc: dict, source: str) -> str:
    """The Markdown page of a ``--json`` results file (``source``: its path)."""
    from testbed.tables import stamp, table

    rows = doc["rows"]
    body = [
        [r["context"], r["tokens"], r["bake_seconds"], f"{r['kl_baked']:.3f}",
         f"{r['kl_unpatched']:.3f}", f"{r['kl_baked'] / r['kl_unpatched']:.2f}x",
         f"{r['top1_baked']:.1%}", f"{r['top1_unpatched']:.1%}", f"{r['own_kl_baked']:.3f}",
         f"{r['own_kl_unpatched']:.3f}", f"{r['own_over_independent']:.2f}x"]
        for r in rows
    ]  # fmt: skip
    head = ["context", "tokens", "bake s", "KL baked", "KL unpatched", "ratio", "top-1 baked",
            "top-1 unpatched", "own KL baked", "own KL unpatched", "own / independent"]  # fmt: skip
    command = invocation("benchmarks.thought.heldout_check", ["--render", source])
    measured = doc.get("command", "python -m benchmarks.thought.heldout_check")
    return "\n".join([
        "# An independent held-out check of `ctxc bake`", "",
        stamp(command, action="Rendered"),
        f"Measured at commit `{doc.get('commit', '?')}` by `{measured}` (bake arguments: "
        f"{doc['bake_args'] or 'none: the defaults'}). Each context baked by `ctxc bake` in a "
        f"new process; then {doc.get('samples', 8)} continuations of {doc.get('tokens', 24)} "
        "tokens drawn by Transformers' `generate(do_sample=True, top_k=0, top_p=1.0, "
        "temperature=1.0)` from the original model fed the context (seeded), and per sampled "
        "token KL(full || patched) with the baked `model/` folder fed BOS + the sample, and "
        "KL(full || unpatched) with the original fed BOS + the sample, both in Transformers "
        "with its defaults. own: the bake's own held-out figure in its `report.json` (its 8 "
        "samples of 16 tokens, its own seed). Passes when the baked KL is below the unpatched "
        "one on every context and own / independent is within 0.8-1.2.", "",
        table(head, body),
        "KL by position in the sample (baked / unpatched), where a patch fitted on 16-token "
        "samples could stop helping:", "",
        table(["context", *range(1, len(rows[0]["kl_baked_by_position"]) + 1)], [
            [r["context"], *(f"{b:.2f}/{u:.2f}" for b, u in
                             zip(r["kl_baked_by_position"], r["kl_unpatched_by_position"],
                                 strict=True))] for r in rows]),
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="factsheet,persona,document")
    parser.add_argument("--model", default=None)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--within", type=float, default=0.2)
    parser.add_argument("--keep", type=Path, default=None, help="keep the bake folders here")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--render", type=Path, default=None, help="print a --json file's page")
    args, bake_args = parser.parse_known_args()
    if args.render:
        print(render(json.loads(args.render.read_text()), str(args.render)), end="")
        return
    bake_args = [a for a in bake_args if a != "--"]
    work = args.keep or Path(tempfile.mkdtemp(prefix="ctxc-heldout-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    for name in args.contexts.split(","):
        row = measure(name, DATA / f"{name}.txt", args, bake_args, work)
        rows.append(row)
        print(
            f"{name}: {row['tokens']} tokens, bake {row['bake_seconds']} s; fresh "
            f"{args.samples}x{args.tokens}: KL baked {row['kl_baked']:.3f} (unpatched "
            f"{row['kl_unpatched']:.3f}), top-1 {row['top1_baked']:.1%} (unpatched "
            f"{row['top1_unpatched']:.1%}); bake's own figure {row['own_kl_baked']:.3f} "
            f"(unpatched {row['own_kl_unpatched']:.3f}): {row['own_over_independent']:.2f}x",
            flush=True,
        )
        if args.json:
            doc = {"bake_args": bake_args, "samples": args.samples, "tokens": args.tokens,
                   "seed": args.seed, "commit": commit(), "rows": rows,
                   "command": invocation("benchmarks.thought.heldout_check")}  # fmt: skip
            args.json.write_text(json.dumps(doc, indent=1))
    below = all(r["kl_baked"] < r["kl_unpatched"] for r in rows)
    close = all(abs(r["own_over_independent"] - 1) <= args.within for r in rows)
    print(
        f"baked below unpatched on every context: {below}; own figure within "
        f"{args.within:.0%}: {close}"
    )
    sys.exit(0 if below and close else 1)


if __name__ == "__main__":
    main()
