"""Cost of one `ctxc generate` step against one cached decode step of the plain model.

A step of the per-token protocol is one cached decode step of the baseline (which also records
the solver's targets) plus one reduced pass that computes and applies every block's patch (with
two or more threads, the two overlap: ``ctxc.generate.steps``). This prints both means and medians
over the same steps, on a context of about 400 tokens, and the ratio of the means. Run it on an
otherwise idle machine: a 2-thread decode step slows several fold beside another busy process.

    python -m benchmarks.cost.generate [--context examples/medium.txt] [--steps 10] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

import ctxc
from ctxc.generate.steps import generate
from ctxc.models.kv_cache import cache_arg, cache_of

ROOT = Path(__file__).resolve().parents[2]


def cached_decode_seconds(model, ids: list[int], steps: int) -> list[float]:
    """Seconds of each greedy cached decode step after a prefill of ``ids``."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        cache = cache_of(out)
        token = int(out.logits[0, -1].argmax())
        times = []
        name = cache_arg(model)  # the KV cache's argument, named once
        for _ in range(steps):
            start = time.perf_counter()
            out = model(input_ids=torch.tensor([[token]]), **{name: cache}, use_cache=True)
            times.append(time.perf_counter() - start)
            cache = cache_of(out)
            token = int(out.logits[0, -1].argmax())
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--context", default=str(ROOT / "examples" / "medium.txt"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    model, tok = ctxc.load_model(args.model, args.dtype)
    ids = tok(Path(args.context).read_text()).input_ids
    # Export, probe and warm-up outside the measurement. The warm-up's first solve registers
    # the solver's stops and its second compiles the stretches between them (compile_segments,
    # a one-off 0.2 s on Gemma 3 270M), so every measured step runs them: the steady state.
    generate(model, ids, 2)
    decode = cached_decode_seconds(model, ids, args.steps)
    result = generate(model, ids, args.steps)
    step = [s.seconds for s in result.steps]
    d, g = statistics.mean(decode), statistics.mean(step)
    print(
        f"context {len(ids)} tokens, {args.steps} steps, {args.dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"cached decode step (plain model): mean {d:.4f} s, median {statistics.median(decode):.4f}"
    )
    print(
        f"generate step (decode + patch):   mean {g:.4f} s  median {statistics.median(step):.4f} s"
    )
    print(f"ratio {g / d:.2f}x   top-1 match {result.match_rate:.0%}")


if __name__ == "__main__":
    main()
