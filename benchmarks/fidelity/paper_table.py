"""The paper's generation table (MATH.md 6, Section 4) on Gemma 3 270M.

The five prompts of the paper's generation runs x N greedy steps x dtypes x update rules. At
every step the patch is recompiled for the current history and the patched model, fed the
current token alone, predicts; after a mismatch the history follows the baseline (teacher
forcing). Prints token match, mean and max |logit diff|, the largest total variation and the
largest post-norm scale change per configuration; `--json FILE` keeps every step.

    python -m benchmarks.fidelity.paper_table [--steps 20] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time

from transformers.utils import logging as hf_logging

import ctxc
from ctxc.generate.steps import generate

PROMPTS = [
    "Write a single-sentence weather forecast for Mars, from the perspective of a slightly "
    "annoyed robot:",
    "Constraint: No 'e's. Topic: The meaning of life. Length: Exactly 20 words. Write:",
    "Explain what a 'bug' is in computer programming, but explain it to a 16th-century medieval "
    "peasant. Use 20 words or less:",
    "Topic: Three siblings named Jack, Fred, and Alice. Task: Write one 5-7-5 haiku about them:",
    "We can absorb the impact of a prompt for a modern language model such as Gemma into the MLP "
    "weights. Write a two-line rhyming couplet about this fact:",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--updates", nargs="+", default=["standard", "stable"])
    parser.add_argument("--json", default=None, help="write every step here")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    rows, dump = [], []
    print(
        f"{'dtype':9} {'rule':9} {'match':>9} {'mean diff':>10} {'max diff':>9} "
        f"{'max TV':>8} {'max dscale':>10} {'s/step':>7}"
    )
    for dtype in args.dtypes:
        model, tok = ctxc.load_model(args.model, dtype)
        for update in args.updates:
            steps, start = [], time.perf_counter()
            for prompt in PROMPTS:
                result = generate(model, tok(prompt).input_ids, args.steps, update=update)
                steps.extend(result.steps)
                dump.append(
                    {"dtype": dtype, "update": update, "prompt": prompt, **result.to_dict()}
                )
            took = (time.perf_counter() - start) / max(1, len(steps))
            matched = sum(s.match for s in steps)
            diffs = [s.max_abs_logit_diff for s in steps]
            changes = [s.max_scale_change for s in steps if s.max_scale_change is not None]
            row = (
                f"{dtype:9} {update:9} {matched:4d}/{len(steps):<4d} "
                f"{sum(diffs) / len(diffs):10.3g} {max(diffs):9.3g} "
                f"{max(s.total_variation for s in steps):8.3g} "
                f"{max(changes) if changes else float('nan'):10.3g} {took:7.2f}"
            )
            rows.append(row)
            print(row, flush=True)
        del model
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dump, f)


if __name__ == "__main__":
    main()
