"""The fit's levers at one (K, R) on one context (issue 13): each setting's held-out figures.

Settings are comma lists of ``name=value`` over ``ridge``, ``scale_ridge``, ``fit_prefix`` (0/1)
and ``output_only`` (0/1); unnamed ones take the benchmark's defaults. The fit data and the
held-out reference are made once (``benchmarks/thought/patches.py``'s ``Bench``):

    python -m benchmarks.thought.levers --context factsheet --samples 32 --rank 64 \\
        --held 8 --qs 8 --gen 8 fit_prefix=1,ridge=0.05,scale_ridge=1 ridge=1,scale_ridge=0.1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import ctxc
from benchmarks.thought.patches import Bench
from ctxc.bake.driver import BakeOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", default="factsheet")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--rank", default="64")
    p.add_argument("--held", type=int, default=8)
    p.add_argument("--qs", type=int, default=8)
    p.add_argument("--gen", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="thought_patch_levers.json")
    p.add_argument("settings", nargs="+")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    defaults = {
        "ridge": BakeOptions.ridge, "scale_ridge": BakeOptions.scale_ridge,
        "fit_prefix": BakeOptions.fit_prefix, "output_only": not BakeOptions.input_moves,
    }  # fmt: skip
    bench_args = argparse.Namespace(
        samples=str(args.samples), held=args.held, qs=args.qs, gen=args.gen, lr=1e-3, seed=0,
        out=args.out, **defaults,
    )  # fmt: skip
    model, tok = ctxc.load_model("gemma-3-270m", "float32")
    out: dict = {"args": vars(args), "rows": [], "fits": [], "timings": []}
    bench = Bench(bench_args, model, tok, args.context, out)
    bench.judge(None, "unpatched", 0, "-", 0.0)
    bench.prepare()
    for setting in args.settings:
        given = dict(kv.split("=") for kv in setting.split(","))
        for name, default in defaults.items():
            value = given.pop(name, default)
            setattr(
                bench_args, name, bool(int(value)) if isinstance(default, bool) else float(value)
            )
        if given:
            raise SystemExit(f"unknown lever(s): {', '.join(given)}")
        print(f"## {setting}", flush=True)
        bench.fit(args.samples, args.rank)
        out["rows"][-1]["setting"] = out["rows"][-2]["setting"] = setting
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
