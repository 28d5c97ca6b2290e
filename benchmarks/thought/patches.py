"""Thought patches on the bundled Gemma 3 270M (float32): held-out fidelity table (issue 13).

For each context (benchmarks/data/<name>.txt): the unpatched model, the mean of exact per-token
patches (Mazzawi et al. 2025), ``fit`` at every (K, R) and ``distill`` (a LoRA trained by context
distillation, given the fit's wall time and ``--factors`` times it; steps reached reported), each
judged on held-out queries of two kinds that never appear in the fit data: fresh samples from the
model fed the context (seed 1) and hand-written questions (benchmarks/data/<name>_questions.txt):
mean KL(full || patched) per token, top-1 agreement and free-generation matched tokens (greedy,
``--gen`` tokens, counted until the first difference).

Bounded in memory and time: the fit data are sampled once at the largest K (seed 0) and the
smaller K take its leading samples; the full runs' targets (fit) and teacher tokens (distill) are
recorded once at the largest K and sliced; the held-out reference (the model fed the context:
float32 logits at every compared position, 1 MiB each, and its greedy tokens) is computed once per
context and every patch is judged against it as soon as it is made, then dropped. Times: the fit's
is its solver (the full runs excluded), distill's budget its training loop (the teacher's runs
excluded); both exclude the sampling. On a shared CPU the times are distorted: say so.

    python -m benchmarks.thought.patches --contexts factsheet --samples 8 --ranks 8 \\
        --methods fit --held 4 --qs 4 --threads 1 --out /tmp/tp.json

Writes the JSON after every row (a killed run keeps what it measured); the table and the plot come
from ``benchmarks/thought/report.py``.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

import ctxc
from ctxc.bake.data import FitData, read_queries, record_fit_targets
from ctxc.bake.distill import teacher_top
from ctxc.bake.driver import BakeOptions, bake, bake_data
from ctxc.bake.evaluate import evaluate_against, reference
from ctxc.core.vocabulary import DISTILL_METHOD, FIT_METHOD
from ctxc.passes.runtime.run_graph import BlockTargets
from ctxc.patch import Delta, Patch
from ctxc.store.traced import traced_blocks

DATA = Path(__file__).resolve().parents[1] / "data"


def peak_gib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def leading_targets(targets: dict[str, BlockTargets], data: FitData, k: int) -> dict:
    """The rows of the first ``k`` queries (rows are stacked query by query)."""
    n = data.part(0, k).positions
    return {p: t.leading(n) for p, t in targets.items()}


def mean_exact_patch(model, data: FitData, positions: int) -> Patch:
    """The mean of the exact per-token patches at ``positions`` fit positions spread evenly
    over the fit queries: the patch of token ``q_j`` compiled with ``context + q[:j]``."""
    picks = [(i, j) for i, q in enumerate(data.queries) for j in range(len(q))]
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


class Bench:
    """One context's runs: the shared data, the reference, and the rows as they come."""

    def __init__(self, args, model, tok, name: str, out: dict):
        self.args, self.model, self.name, self.out = args, model, name, out
        ids = list(tok((DATA / f"{name}.txt").read_text()).input_ids)
        ks = sorted(int(x) for x in args.samples.split(","))
        clock = time.perf_counter()
        self.data = bake_data(model, tok, ids, None, ks[-1], 32, seed=0)
        self.note("sampling", time.perf_counter() - clock, K=ks[-1])
        prefix = self.data.prefix
        texts = read_queries(DATA / f"{name}_questions.txt")[: args.qs]
        held = {
            "samples": bake_data(model, tok, ids, None, args.held, 32, seed=1, prefix=prefix),
            "questions": bake_data(model, tok, ids, texts, 0, 32, seed=1, prefix=prefix),
        }
        clock = time.perf_counter()
        self.refs = {kind: reference(model, d, args.gen) for kind, d in held.items()}
        self.note("reference", time.perf_counter() - clock)
        self.targets = self.teacher = None

    def note(self, what: str, seconds: float, **extra) -> None:
        entry = {"context": self.name, "what": what, "seconds": round(seconds, 1), **extra}
        self.out["timings"].append(entry)
        print(f"# {self.name}: {what} {seconds:.0f} s {extra or ''}", flush=True)

    def judge(self, patch, method: str, k, r, seconds: float, **extra) -> None:
        """Rows of ``patch`` on both held-out kinds; the JSON is rewritten."""
        for kind, ref in self.refs.items():
            e = evaluate_against(self.model, patch, ref)
            row = {
                "context": self.name, "held_out": kind, "method": method, "K": k, "R": r,
                "kl": e.kl, "top1": e.top1, "matched": e.matched, "gen_tokens": e.gen_tokens,
                "queries": e.queries, "positions": e.positions, "seconds": round(seconds, 1),
                "peak_gib": round(peak_gib(), 2), **extra,
            }  # fmt: skip
            self.out["rows"].append(row)
            print(line(row), flush=True)
        Path(self.args.out).write_text(json.dumps(self.out, indent=1) + "\n")

    def prepare(self) -> None:
        """The full runs' targets at the largest K, once."""
        traced, blocks = traced_blocks(self.model)
        clock = time.perf_counter()
        self.targets = record_fit_targets(traced, blocks, self.data)
        self.note("fit targets (full runs)", time.perf_counter() - clock)

    def teacher_for(self, k: int) -> list:
        """The teacher's top tokens of the first ``k`` queries (recorded once, as needed)."""
        have = len(self.teacher or [])
        if have < k:
            clock = time.perf_counter()
            more = teacher_top(self.model, self.data.part(0, k))[have:]
            self.teacher = (self.teacher or []) + more
            self.note("distill teacher (full runs)", time.perf_counter() - clock, K=k)
        return self.teacher[:k]

    def options(self, r: str, method: str, **extra) -> BakeOptions:
        a = self.args
        return BakeOptions(
            rank=None if r == "full" else int(r), method=method, ridge=a.ridge,
            scale_ridge=a.scale_ridge, fit_prefix=a.fit_prefix, distill_lr=a.lr,
            input_moves=not a.output_only, **extra,
        )  # fmt: skip

    def fit(self, k: int, r: str) -> float:
        data = self.data.part(0, k)
        clock = time.perf_counter()
        result = bake(
            self.model, data=data, targets=leading_targets(self.targets, self.data, k),
            options=self.options(r, FIT_METHOD),
        )  # fmt: skip
        seconds = time.perf_counter() - clock
        blocks = [
            {"path": b["path"], "move_residuals": b["move_residuals"],
             "residual_rms": b["residual_rms"], "target_rms": b["target_rms"],
             "effective_rank": b["effective_rank"]}
            for b in result.report["blocks"]
        ]  # fmt: skip
        self.out["fits"].append({"context": self.name, "K": k, "R": r, "blocks": blocks})
        self.judge(result.patch, FIT_METHOD, k, r, seconds, fit_positions=data.positions)
        return seconds

    def distill(self, k: int, r: str, seconds: float, factor: float) -> None:
        data = self.data.part(0, k)
        opts = self.options(
            r, DISTILL_METHOD, distill_seconds=seconds * factor, seed=self.args.seed
        )
        result = bake(self.model, data=data, teacher=self.teacher_for(k), options=opts)
        d = result.report["distill"]
        self.judge(
            result.patch, DISTILL_METHOD, k, r, d["seconds"], budget=f"{factor:g}x fit",
            steps=d["steps"], lora_rank=d["rank"], last_loss=d["last_loss"],
        )  # fmt: skip


def run_context(args, model, tok, name: str, out: dict) -> None:
    """Unpatched, mean of exact patches, every fit, then distill where ``--distill-at`` says:
    ``best`` (the fit with the lowest KL on fresh samples), ``all``, or ``K:R`` pairs."""
    bench = Bench(args, model, tok, name, out)
    bench.judge(None, "unpatched", 0, "-", 0.0)
    ks = sorted(int(x) for x in args.samples.split(","))
    if args.mean_exact:
        k = args.mean_exact_k or ks[0]
        clock = time.perf_counter()
        patch = mean_exact_patch(model, bench.data.part(0, k), args.mean_exact)
        bench.judge(patch, "mean-exact", k, "-", time.perf_counter() - clock,
                    exact_positions=args.mean_exact)  # fmt: skip
        del patch
    methods = args.methods.split(",")
    times: dict[tuple[str, str], float] = {}
    if FIT_METHOD in methods:
        bench.prepare()
        for k in ks:
            for r in args.ranks.split(","):
                times[(str(k), r)] = bench.fit(k, r)
    if DISTILL_METHOD not in methods:
        return
    if not times and args.fit_times:  # an earlier run's fit times, for distill's budgets
        rows = json.loads(Path(args.fit_times).read_text())["rows"]
        times = {
            (str(x["K"]), str(x["R"])): x["seconds"]
            for x in rows
            if x["context"] == name and x["method"] == FIT_METHOD
        }
    if args.distill_at == "best" and times:
        fits = [x for x in out["rows"] if x["context"] == name and x["method"] == FIT_METHOD]
        best = min((x for x in fits if x["held_out"] == "samples"), key=lambda x: x["kl"])
        picked = [(str(best["K"]), str(best["R"]))]
    elif args.distill_at in ("all", "best"):
        picked = [(str(k), r) for k in ks for r in args.ranks.split(",")]
    else:
        picked = [tuple(p.split(":")) for p in args.distill_at.split(",")]
    for k, r in picked:
        for factor in [float(f) for f in args.factors.split(",")]:
            bench.distill(int(k), r, times.get((k, r), args.distill_seconds), factor)


def line(row: dict) -> str:
    extra = f" ({row['budget']}, {row['steps']} steps)" if row.get("budget") else ""
    return (
        f"| {row['context']} | {row['held_out']} | {row['method']}{extra} | {row['K']} | "
        f"{row['R']} | {row['kl']:.3f} | {row['top1']:.1%} | "
        f"{row['matched']:.2f}/{row['gen_tokens']} | {row['seconds']} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="factsheet,persona,document")
    p.add_argument("--samples", default="8,32,128", help="K values, comma list")
    p.add_argument("--ranks", default="8,64,full", help="R values, comma list")
    p.add_argument("--methods", default="fit,distill")
    p.add_argument("--factors", default="1,10", help="distill budgets, times the fit's time")
    p.add_argument("--distill-at", default="best", help="best, all, or K:R pairs")
    p.add_argument("--distill-seconds", type=float, default=60.0, help="budget without fit")
    p.add_argument("--fit-times", default="", help="JSON of an earlier run: its fit times")
    p.add_argument("--ridge", type=float, default=BakeOptions.ridge)
    p.add_argument("--scale-ridge", type=float, default=BakeOptions.scale_ridge)
    p.add_argument("--lr", type=float, default=BakeOptions.distill_lr)
    p.add_argument("--seed", type=int, default=0, help="distill's seed")
    p.add_argument("--held", type=int, default=16, help="held-out samples (seed 1)")
    p.add_argument("--qs", type=int, default=20, help="hand-written questions per context")
    p.add_argument("--gen", type=int, default=32, help="greedy tokens per held-out query")
    p.add_argument("--mean-exact", type=int, default=16, help="positions averaged; 0: skip")
    p.add_argument("--mean-exact-k", type=int, default=0, help="over K samples (0: least K)")
    p.add_argument("--fit-prefix", action="store_true", help="fit the BOS position too")
    p.add_argument("--output-only", action="store_true", help="fit: no input moves")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default="thought_patches.json")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = ctxc.load_model("gemma-3-270m", "float32")
    out: dict = {"args": vars(args), "rows": [], "fits": [], "timings": []}
    print("| context | held out | method | K | R | KL | top-1 | matched | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.contexts.split(","):
        run_context(args, model, tok, name, out)
    out["peak_gib"] = round(peak_gib(), 2)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"# peak RSS {out['peak_gib']} GiB; wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
