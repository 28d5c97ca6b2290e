"""Multi-token queries on the real Gemma 3 270M (issue 15, item 8, check 3).

Every block of this model ends in a scaled post norm (Gemma 3's post-feedforward norm), so a
k-token query needs one scale shared by k positions (passes/solver/multi_scale.py). For each
context and
query: compile, write ``DIR/model`` with the torch backend, load it back with plain Transformers,
feed it the query ids alone and compare its logits at every query position with the original
model fed context + query. Prints, per query, max |logit diff| per position, the largest total
variation, top-1 agreement at every position, the unpatched control's max |logit diff| and the
largest post-norm gain ``max |s'|`` over the blocks.

    python -m benchmarks.fidelity.multi_token [--model M] [--dtype float32]
        [--updates stable standard] [--texts short medium] [--cases 0 3]
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
CASES = [
    ("short", " The name of the keeper's cat was"),
    ("short", " His cat"),
    ("short", " The keeper lived with a"),
    ("medium", " The name of the keeper's cat was"),
    ("medium", " The river"),
    ("medium", " In the spring the people"),
]


def measure(model, tok, text: str, query: str, update: str) -> dict:
    """Compile, emit, reload with plain Transformers and compare every query position."""
    result = ctxc.compile(model, tok, context=text, query=query, update=update)
    rep = result.report
    q = torch.tensor([rep.query_ids])  # [1, k]
    k = q.shape[1]
    with tempfile.TemporaryDirectory() as tmp:
        emit_torch(model, tok, result.patch, Path(tmp))
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=model.dtype).eval()
        with torch.no_grad():
            got = reloaded(q).logits[0].float()  # [k, vocab]
        del reloaded
    with torch.no_grad():
        full = model(torch.tensor([rep.context_ids + rep.query_ids])).logits[0, -k:].float()
        ctl = model(q).logits[0].float()  # [k, vocab]
    per_pos = (got - full).abs().amax(dim=-1)  # [k]
    fid, ctl_fid = fidelity(got, full), fidelity(ctl, full)
    gains = [b.max_gain for b in rep.blocks if b.max_gain == b.max_gain]
    return {
        "tokens": len(rep.context_ids) + k,
        "k": k,
        "per_position": [float(x) for x in per_pos],
        "max": fid.max_abs_logit_diff,
        "tv": fid.total_variation,
        "top1": fid.top1_match,
        "solver": rep.patched.max_abs_logit_diff,
        "control": ctl_fid.max_abs_logit_diff,
        "control_top1": ctl_fid.top1_match,
        "max_gain": max(gains) if gains else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--updates", nargs="+", default=["stable"])
    parser.add_argument("--texts", nargs="+", default=["short", "medium"])
    parser.add_argument("--cases", nargs="+", type=int, default=None, help="indices into CASES")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    model, tok = ctxc.load_model(args.model, args.dtype)
    for i, (name, query) in enumerate(CASES):
        if name not in args.texts or (args.cases is not None and i not in args.cases):
            continue
        text = (ROOT / "examples" / f"{name}.txt").read_text()
        for update in args.updates:
            try:
                m = measure(model, tok, text, query, update)
            except ctxc.CtxcError as exc:
                print(f"{name} {query!r} {update}: refused: {exc}", flush=True)
                continue
            per = " ".join(f"{x:.2g}" for x in m["per_position"])
            print(
                f"{name} ({m['tokens']} tok.) {query!r} k={m['k']} {update}: "
                f"max {m['max']:.3g} [per position {per}] TV {m['tv']:.2g} top1 {m['top1']} | "
                f"solver {m['solver']:.3g} | control {m['control']:.3g} "
                f"(top1 {m['control_top1']}) | largest gain {m['max_gain']:.3g}",
                flush=True,
            )


if __name__ == "__main__":
    main()
