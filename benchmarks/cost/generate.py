"""Cost of one `ctxc generate` step against one cached decode step of the plain model.

A step of the per-token protocol is one cached decode step of the baseline (which also records
the solver's targets) plus one reduced pass that computes and applies every block's patch (with
two or more threads, the two overlap: ``ctxc.generate.steps``). This prints both means and medians
over the same steps, on a context of about 400 tokens, and the ratio of the means. Run it on an
otherwise idle machine: a 2-thread decode step slows several fold beside another busy process.

It also prints the protocol's floor, the same steps with no patch work at all: the cached decode
step and the plain model's own forward of the same one token without a cache (what the patched
side runs: it sees only the current token, and reads every weight and the LM head again), one
after the other, and side by side (the decode on a worker thread, as ``ctxc generate`` runs it:
two threads streaming different weights read faster than one). A protocol that keeps the plain
runtime's decode as its reference and runs the patched model's own forward costs at least that.
Last, the run the solver steps through, with no patch work: the exported graph on the token
alone, stopping where the solver stops (``ReducedRun``, its stretches between stops compiled),
against the plain one-token forward. A step with every solver op taken out would be the decode
plus that run.

    python -m benchmarks.cost.generate [--context examples/medium.txt] [--steps 10] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

import ctxc
from ctxc.generate.steps import generate
from ctxc.models.kv_cache import cache_arg, cache_of
from ctxc.passes.locate.graph_view import GraphView
from ctxc.passes.runtime.reduced_run import ReducedRun
from ctxc.store.traced import traced_blocks

ROOT = Path(__file__).resolve().parents[2]


def cached_decode_seconds(model, ids: list[int], steps: int) -> dict[str, list[float]]:
    """Seconds per greedy step after a prefill of ``ids``, in three runs of ``steps`` steps,
    each from its own prefill: the cached decode step (``decode``: a plain generation loop, the
    comparison), the decode step then the plain forward of its token alone without a cache
    (``one_after_other``), and the two side by side, the decode on a worker thread
    (``side_by_side``). Only the first is the decode's time: beside other work a decode step
    slows (its weights no longer stream alone), as it does inside ``ctxc generate``."""
    name = cache_arg(model)  # the KV cache's argument, named once

    def decode(token: int, cache):
        with torch.no_grad():  # grad mode is per thread
            return model(input_ids=torch.tensor([[token]]), **{name: cache}, use_cache=True)

    def forward_alone(token: int) -> None:
        with torch.no_grad():
            model(input_ids=torch.tensor([[token]]), use_cache=False)

    times: dict[str, list[float]] = {"decode": [], "one_after_other": [], "side_by_side": []}
    with ThreadPoolExecutor(1) as worker:
        for how, seconds in times.items():
            with torch.no_grad():
                out = model(input_ids=torch.tensor([ids]), use_cache=True)
            for _ in range(steps):
                cache, token = cache_of(out), int(out.logits[0, -1].argmax())
                start = time.perf_counter()
                if how == "side_by_side":
                    pending = worker.submit(decode, token, cache)
                    forward_alone(token)
                    out = pending.result()
                else:
                    out = decode(token, cache)
                    if how == "one_after_other":
                        forward_alone(token)
                seconds.append(time.perf_counter() - start)
    return times


def reduced_run_seconds(model, tokens: list[int]) -> dict[str, list[float]]:
    """Seconds of the solver's run with no patch work (``reduced``: the graph on one token,
    stopping at every node the solver reads, the stretches between compiled) and of the plain
    model's forward of the same token without a cache (``forward``), alternating, per token."""
    traced, blocks = traced_blocks(model)
    view = GraphView.of(traced)
    times: dict[str, list[float]] = {"reduced": [], "forward": []}
    with torch.no_grad():
        # Two warm-up runs: the first registers the stops, the second compiles the stretches
        # between them (compile_segments), as in generate's own warm-up.
        for token in [tokens[0], tokens[0], *tokens]:
            ids = torch.tensor([[token]])
            start = time.perf_counter()
            ReducedRun(view, (), traced.placeholder_values(ids), blocks.node_names).finish()
            times["reduced"].append(time.perf_counter() - start)
            start = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            times["forward"].append(time.perf_counter() - start)
    return {k: v[2:] for k, v in times.items()}  # the warm-up left out


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
    plain = cached_decode_seconds(model, ids, args.steps)
    result = generate(model, ids, args.steps)
    alone = reduced_run_seconds(model, [s.baseline_token for s in result.steps])
    step = [s.seconds for s in result.steps]
    d, g = statistics.mean(plain["decode"]), statistics.mean(step)
    seq, both = statistics.mean(plain["one_after_other"]), statistics.mean(plain["side_by_side"])
    print(
        f"context {len(ids)} tokens, {args.steps} steps, {args.dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"cached decode step (plain model): mean {d:.4f} s, "
        f"median {statistics.median(plain['decode']):.4f}"
    )
    print(
        f"generate step (decode + patch):   mean {g:.4f} s  median {statistics.median(step):.4f} s"
    )
    print(
        f"floor (the decode and the plain forward of its token alone, no patch work): "
        f"one after the other {seq:.4f} s ({seq / d:.2f}x), side by side {both:.4f} s "
        f"({both / d:.2f}x)"
    )
    run, fwd = statistics.mean(alone["reduced"]), statistics.mean(alone["forward"])
    print(
        f"the solver's run with no patch work {run:.4f} s (the plain one-token forward "
        f"{fwd:.4f} s): the decode and it {(d + run) / d:.2f}x, a step without the solver's math"
    )
    print(
        f"ratio {g / d:.2f}x a decode step, {g / min(both, seq):.2f}x the floor   "
        f"top-1 match {result.match_rate:.0%}"
    )


if __name__ == "__main__":
    main()
