"""Thought patches on the bundled Gemma 3 270M (float32): held-out fidelity table (issue 13).

For each context (benchmarks/data/<name>.txt) and each (K, R, method): bake, then measure on
held-out queries of two kinds that never appear in the fit data, fresh samples from the model
fed the context (seed 1) and hand-written questions (benchmarks/data/<name>_questions.txt):
mean KL(full || patched) per token, top-1 agreement and free-generation matched tokens, beside
the unpatched model and the mean of exact per-token patches (Mazzawi et al. 2025). Writes a
JSON file and prints a Markdown table. CPU speed on a shared machine: timings are distorted.

    python benchmarks/thought_patches.py --contexts factsheet --samples 32 --ranks 64,full \
        --methods fit --out thought_patches.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import ctxc
from ctxc.bake import BakeOptions, bake, bake_data
from ctxc.bake_data import FitData, read_queries
from ctxc.bake_eval import evaluate_many
from ctxc.patch import Delta, Patch

DATA = Path(__file__).resolve().parent / "data"


def mean_exact_patch(model, data: FitData, positions: int) -> Patch:
    """The mean of the exact per-token patches at ``positions`` fit positions, spread over the
    fit queries: the patch of token ``q_j`` compiled with ``context + q[:j]`` before it."""
    picks = []
    for i, q in enumerate(data.queries):
        for j in range(len(q)):
            picks.append((i, j))
    step = max(1, len(picks) // positions)
    patches = []
    for i, j in picks[::step][:positions]:
        q = data.queries[i]
        result = ctxc.compile(model, context_ids=data.context_ids + q[:j], query_ids=[q[j]])
        patches.append(result.patch)
    n = len(patches)
    deltas = {}
    for name, first in patches[0].deltas.items():
        group = [p.deltas[name] for p in patches]
        if first.vector is not None:
            deltas[name] = Delta(name, first.block, vector=sum(d.vector for d in group) / n)
        else:
            u = torch.cat([d.u for d in group], dim=1) / n  # [out, n]
            v = torch.cat([d.v for d in group], dim=1)  # [in, n]
            deltas[name] = Delta(name, first.block, u=u, v=v, layout=first.layout)
    return Patch(deltas, patches[0].meta)


def held_out(model, tok, ctx_ids, prefix, name: str, samples: int, questions: int):
    sets = {"samples": bake_data(model, tok, ctx_ids, None, samples, 32, seed=1, prefix=prefix)}
    texts = read_queries(DATA / f"{name}_questions.txt")[:questions]
    sets["questions"] = bake_data(model, tok, ctx_ids, texts, 0, 32, seed=1, prefix=prefix)
    return sets


def run(args) -> list[dict]:
    model, tok = ctxc.load_model("gemma-3-270m", "float32")
    rows = []
    for name in args.contexts.split(","):
        ctx_ids = list(tok((DATA / f"{name}.txt").read_text()).input_ids)
        # label -> (patch or None, K, R, seconds); every one is judged on the same held-out runs
        made: dict[str, tuple] = {"unpatched": (None, 0, "-", 0.0)}
        fit_data = None
        for k in [int(x) for x in args.samples.split(",")]:
            fit_data = None
            for r in args.ranks.split(","):
                for method in args.methods.split(","):
                    opts = BakeOptions(
                        samples=k, rank=None if r == "full" else int(r), method=method,
                        ridge=args.ridge, scale_ridge=args.scale_ridge, distill_steps=args.steps,
                        fit_prefix=not args.no_fit_prefix,
                    )  # fmt: skip
                    clock = time.perf_counter()
                    if fit_data is None:
                        result = bake(model, tok, context_ids=ctx_ids, options=opts)
                        fit_data = result.data
                    else:
                        result = bake(model, data=fit_data, options=opts)
                    seconds = time.perf_counter() - clock
                    made[f"{method} K={k} R={r}"] = (result.patch, k, r, seconds)
                    print(f"baked {method} K={k} R={r} in {seconds:.0f} s", flush=True)
            if args.mean_exact:
                clock = time.perf_counter()
                patch = mean_exact_patch(model, fit_data, args.mean_exact)
                made[f"mean-exact({args.mean_exact}) K={k}"] = (
                    patch,
                    k,
                    "-",
                    time.perf_counter() - clock,
                )
        prefix = fit_data.prefix if fit_data else []
        sets = held_out(model, tok, ctx_ids, prefix, name, args.held, args.qs)
        labels = list(made)
        for kind, d in sets.items():
            found = evaluate_many(model, [made[lb][0] for lb in labels], d, args.gen)
            for lb, e in zip(labels, found, strict=True):
                _, k, r, seconds = made[lb]
                rows.append(_row(name, kind, lb.split(" ")[0], k, r, e, seconds))
                print(_line(rows[-1]), flush=True)
    return rows


def _row(context, kind, method, k, r, e, seconds) -> dict:
    return {
        "context": context, "held_out": kind, "method": method, "K": k, "R": r,
        "kl": e.kl, "top1": e.top1, "matched": e.matched, "gen_tokens": e.gen_tokens,
        "queries": e.queries, "positions": e.positions, "seconds": round(seconds, 1),
    }  # fmt: skip


def _line(row: dict) -> str:
    return (
        f"| {row['context']} | {row['held_out']} | {row['method']} | {row['K']} | {row['R']} | "
        f"{row['kl']:.3f} | {row['top1']:.1%} | {row['matched']:.1f}/{row['gen_tokens']} | "
        f"{row['seconds']} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="factsheet,persona,document")
    p.add_argument("--samples", default="8,32,128", help="K values, comma list")
    p.add_argument("--ranks", default="8,64,full", help="R values, comma list")
    p.add_argument("--methods", default="fit,distill")
    p.add_argument("--ridge", type=float, default=BakeOptions.ridge)
    p.add_argument("--scale-ridge", type=float, default=BakeOptions.scale_ridge)
    p.add_argument("--steps", type=int, default=BakeOptions.distill_steps)
    p.add_argument("--held", type=int, default=16, help="held-out samples (seed 1)")
    p.add_argument("--qs", type=int, default=20, help="hand-written questions per context")
    p.add_argument("--gen", type=int, default=32, help="greedy tokens per held-out query")
    p.add_argument("--mean-exact", type=int, default=16, help="positions averaged; 0: skip")
    p.add_argument("--no-fit-prefix", action="store_true", help="BOS position not fitted")
    p.add_argument("--out", default="thought_patches.json")
    args = p.parse_args()
    print("| context | held out | method | K | R | KL | top-1 | matched | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = run(args)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
