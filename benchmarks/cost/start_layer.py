"""The paper's ablation C.4: blocks below the start layer stay unpatched.

For each start layer N, compiles the context on Gemma 3 270M with blocks 0..N-1 unpatched (block N
absorbs the whole accumulated difference) and prints the emitted model's fidelity, the largest
post-norm scale change and gain, and the total patch norm.

    python -m benchmarks.cost.start_layer [--context examples/short.txt] [--layers 0 4 8 12 16 17]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transformers.utils import logging as hf_logging

import ctxc

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", default=str(ROOT / "examples" / "short.txt"))
    parser.add_argument("--layers", nargs="+", type=int, default=[0, 4, 8, 12, 16, 17])
    parser.add_argument("--updates", nargs="+", default=["standard", "stable"])
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    model, tok = ctxc.load_model(args.model)
    text = Path(args.context).read_text()
    print(
        f"{'rule':9} {'start':>5} {'max diff':>9} {'TV':>9} {'top1':>5} {'control':>8} "
        f"{'max dscale':>10} {'max gain':>9} {'sum |dW|':>9}"
    )
    for update in args.updates:
        for n in args.layers:
            rep = ctxc.compile(model, tok, context=text, update=update, start_layer=n).report
            e = rep.emitted
            patched = [b for b in rep.blocks if b.patched]
            change = max(
                (b.max_scale_change for b in patched if b.max_scale_change is not None),
                default=float("nan"),
            )
            gain = max(
                (b.max_gain for b in patched if b.max_gain is not None), default=float("nan")
            )
            norm = sum(sum((b.delta_norms or {}).values()) for b in patched)
            print(
                f"{update:9} {n:5d} {e.max_abs_logit_diff:9.3g} {e.total_variation:9.2g} "
                f"{e.top1_match!s:>5} {rep.control.max_abs_logit_diff:8.3g} {change:10.3g} "
                f"{gain:9.3g} {norm:9.3g}",
                flush=True,
            )


if __name__ == "__main__":
    main()
