"""The table ``ctxc bake``'s defaults are chosen from (issue 25): time and held-out figures.

For each context (a ``benchmarks/thought/questions/<name>.json``: its context file and held-out
questions) and each setting (``name=value`` comma lists over :class:`BakeOptions` fields:
``data``, ``samples``, ``sample_tokens``, ``questions``, ``answer_tokens``, ``rank``,
``method``, ``distill_seconds``, ``distill_from_fit``...), a bake from scratch as ``ctxc bake``
runs it (sampling / self-study, the cached full runs, the fit),
its seconds by stage, then its held-out figures beside the unpatched model's:

- fresh continuation samples (seed 1, ``--held`` of ``--held-tokens``): KL(full || patched)
  per token, top-1 agreement;
- the held-out questions (``Question: ...\\nAnswer:``, never in the fit data): KL, top-1, and the
  share answered as the full-context model answers (greedy, first sentence exact);
- unrelated questions (``questions/unrelated.json``) after the same context: KL of the patched
  model over the unpatched model's (the out-of-context guard: < 1.10 is the goal).

The references (the model fed the context) are computed once per context. Writes the JSON
after every row:

    python -m benchmarks.thought.defaults --contexts medium --out /tmp/d.json \\
        data=continuations,samples=8,sample_tokens=16 data=both,samples=16,questions=16
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import ctxc
from ctxc.bake.driver import BakeOptions, bake, bake_data
from ctxc.bake.evaluate import evaluate_against, reference
from ctxc.bake.selfstudy import as_question
from ctxc.core.options import bake_fields

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = Path(__file__).resolve().parent / "questions"
# Each field's type as BakeOptions declares it (its annotations are strings: PEP 563).
_TYPES = {f.name: str(f.type) for f in bake_fields()}


def options(setting: str) -> BakeOptions:
    """A setting ``a=1,b=x`` as :class:`BakeOptions` (``rank=full``: no budget; no ``rank``:
    the default budget, ``DEFAULT_RANK``)."""
    given: dict = {}
    for kv in setting.split(","):
        name, value = kv.split("=")
        kind = _TYPES[name]
        if name == "rank":
            given[name] = None if value == "full" else int(value)
        elif kind.startswith("bool"):
            given[name] = {"true": True, "false": False}[value]
        elif kind.startswith("int"):
            given[name] = int(value)
        elif kind.startswith("float"):
            given[name] = float(value)
        else:
            given[name] = value
    return BakeOptions(**given)


def references(args, model, tok, name: str):
    """The context's ids and the three held-out references."""
    spec = json.loads((QUESTIONS / f"{name}.json").read_text())
    ids = list(tok((ROOT / spec["context"]).read_text()).input_ids)
    unrelated = json.loads((QUESTIONS / "unrelated.json").read_text())["questions"]
    ask = [as_question(q) for q in spec["questions"]]
    other = [as_question(q) for q in unrelated]
    sets = {
        "samples": bake_data(model, tok, ids, None, args.held, args.held_tokens, seed=1),
        "questions": bake_data(model, tok, ids, ask, 0, 1, seed=1),
        "unrelated": bake_data(model, tok, ids, other, 0, 1, seed=1),
    }
    gens = {"samples": args.held_tokens, "questions": args.gen, "unrelated": 0}
    return ids, {
        k: reference(model, d, gens[k], tokenizer=tok if k == "questions" else None)
        for k, d in sets.items()
    }


def judge(model, patch, refs) -> dict:
    out = {}
    for kind, ref in refs.items():
        e = evaluate_against(model, patch, ref)
        out[kind] = {
            "kl": e.kl, "top1": e.top1, "matched": e.matched, "answers": e.answers,
            "matched_all": e.matched_all, "answer_len": list(ref.answer_len or []),
        }  # fmt: skip
        if ref.answer_len:  # the first N = 4 tokens of the answer (or its first sentence)
            first = [m >= min(4, n) for m, n in zip(e.matched_all, ref.answer_len, strict=True)]
            out[kind]["answers_4"] = sum(first) / len(first)
    return out


def row_line(row: dict) -> str:
    p, c = row["patched"], row["unpatched"]
    ans = p["questions"]["answers"]
    return (
        f"| {row['context']} | {row['setting']} | {row['seconds']['total']:.0f} | "
        f"{p['samples']['kl']:.3f} ({p['samples']['kl'] / c['samples']['kl']:.2f}x) | "
        f"{p['samples']['top1']:.0%} | {p['questions']['kl']:.3f} "
        f"({p['questions']['kl'] / c['questions']['kl']:.2f}x) | {p['questions']['top1']:.0%} | "
        f"{ans:.0%} (unp. {c['questions']['answers']:.0%}) | "
        f"{p['questions']['answers_4']:.0%} (unp. {c['questions']['answers_4']:.0%}) | "
        f"{p['unrelated']['kl'] / c['unrelated']['kl']:.2f}x |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="medium,science,history")
    p.add_argument("--held", type=int, default=8, help="held-out samples (seed 1)")
    p.add_argument("--held-tokens", type=int, default=16)
    p.add_argument("--gen", type=int, default=24, help="greedy answer tokens compared")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="bake_defaults.json")
    p.add_argument("settings", nargs="+")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = ctxc.load_model("gemma-3-270m", "float32")
    out: dict = {"args": vars(args), "threads": torch.get_num_threads(), "rows": []}
    print(
        "| context | setting | s | samples KL | top-1 | questions KL | top-1 | answers "
        "| first 4 | unrel. |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.contexts.split(","):
        ids, refs = references(args, model, tok, name)
        control = judge(model, None, refs)
        for setting in args.settings:
            load = os.getloadavg()[0]
            clock = time.perf_counter()
            result = bake(model, tok, context_ids=ids, options=options(setting))
            total = time.perf_counter() - clock
            row = {
                "context": name, "setting": setting, "load_before": round(load, 1),
                "load_after": round(os.getloadavg()[0], 1),
                "seconds": {**result.report["timings"], "total": round(total, 1)},
                "fit_positions": result.report["fit_positions"],
                "fit_kinds": result.report["fit_kinds"],
                "patched": judge(model, result.patch, refs), "unpatched": control,
            }  # fmt: skip
            out["rows"].append(row)
            print(row_line(row), flush=True)
            Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
