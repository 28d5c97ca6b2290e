"""Fidelity of the emitted model on the real Gemma 3 270M (issue 2, check 1).

For each example context and update rule: compile, write ``DIR/model`` with the torch backend,
load it back with plain Transformers, feed it the query ids alone and compare its last-position
logits with the original model fed context + query. Prints max |logit diff|, total variation and
top-1 agreement beside the unpatched control's, and the solver's own figure.

    python -m benchmarks.fidelity.emitted [--model M] [--dtype float32] [--texts short medium long]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

import ctxc
from ctxc.backends.torch.model import emit_torch
from ctxc.core.metrics import fidelity

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--texts", nargs="+", default=["short", "medium", "long"])
    parser.add_argument("--updates", nargs="+", default=["standard", "stable"])
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    model, tok = ctxc.load_model(args.model, args.dtype)
    header = (
        f"{'text':8} {'tokens':>6} {'rule':9} {'solver':>9} {'reloaded':>9} {'TV':>9} "
        f"{'top1':>5} {'control':>8} {'ctl TV':>7} {'max gain':>9}"
    )
    print(header)
    print("-" * len(header))
    for name in args.texts:
        text = (ROOT / "examples" / f"{name}.txt").read_text()
        for update in args.updates:
            result = ctxc.compile(model, tok, context=text, update=update)
            rep = result.report
            with tempfile.TemporaryDirectory() as tmp:
                emit_torch(model, tok, result.patch, Path(tmp))
                reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=model.dtype).eval()
                with torch.no_grad():
                    got = reloaded(torch.tensor([rep.query_ids])).logits[0, -1:]
                del reloaded
            with torch.no_grad():
                full_ids = torch.tensor([rep.context_ids + rep.query_ids])
                full = model(full_ids).logits[0, -1:]
            fid = fidelity(got, full)
            gains = [b.max_gain for b in rep.blocks if b.max_gain is not None]
            print(
                f"{name:8} {len(rep.context_ids) + len(rep.query_ids):6d} {update:9} "
                f"{rep.patched.max_abs_logit_diff:9.3g} {fid.max_abs_logit_diff:9.3g} "
                f"{fid.total_variation:9.2g} {fid.top1_match!s:>5} "
                f"{rep.control.max_abs_logit_diff:8.3g} {rep.control.total_variation:7.3g} "
                f"{max(gains) if gains else float('nan'):9.3g}",
                flush=True,
            )


if __name__ == "__main__":
    main()
