"""One llama.cpp model, N ``lora.gguf`` adapters switched per request (issue 23, check 3).

Compiles N contexts (default the ten shortest of examples/*.txt and benchmarks/texts/*.txt) with
one query on the bundled Gemma 3 270M with ``--update lora`` (or ``--update``), writes each
``lora.gguf``, and loads ONE base in llama.cpp (the model written once as an F32 GGUF, and the
bundled Q4_K_M file) with all N adapters loaded once. The requests run the query with adapter
after adapter (``llama_set_adapters_lora``), first on one context whose KV cache is cleared
between requests (a server's way), then on a fresh context per request. Per context and base:
max |dlogit| from llama.cpp's own full-context run of that context on the same base (``own``,
the worst over its requests), the bound of check 2 (``2 x max(floor, full-vs-T) + own-T``: the
query-alone floor of llama.cpp against Transformers, the same on context + query, and the torch
patched model's own distance; on the Q4_K_M base reported, not checked), the nearest other
context's full-context run (should be far), top-1. Then the switch cost: a request that
switches adapter (set + decode) against one that keeps it (decode), the query alone without an
adapter, a request on a fresh context, loading an adapter.

    pip install ".[llamacpp]" && bash tools/llamacpp/install.sh .venv/bin/python  # glibc < 2.38
    python -m benchmarks.fidelity.llama_cpp_adapters [--contexts 10] [--texts short 01_greeting ...]
        [--query TEXT] [--update lora] [--threads 1] [--no-q4] [--json FILE] [--results FILE.md]

Timings depend on the machine's load: on a shared machine, rerun them quietly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

import ctxc
from ctxc.backends.gguf.llama_cpp.run import (
    LLAMA_CPP_FACTOR,
    LLAMA_CPP_MIN_FLOOR,
    LlamaCppSwitching,
    llama_cpp_logits,
    llama_cpp_switching,
    llama_cpp_unavailable,
    llama_cpp_version,
)
from ctxc.backends.gguf.lora import write_gguf_lora
from ctxc.backends.gguf.write import write_gguf
from ctxc.backends.reference import reference_logits, torch_logits
from ctxc.core.metrics import fidelity
from ctxc.models.load import source_gguf
from testbed.tables import invocation, table, write_table

ROOT = Path(__file__).resolve().parents[2]
QUERY = "\nQuestion: What is this text about?\nAnswer:"


def _paths() -> dict[str, Path]:
    """Every text by name: examples/*.txt and benchmarks/texts/*.txt."""
    found = {p.stem: p for p in sorted((ROOT / "benchmarks/texts").glob("*.txt"))}
    found.update({p.stem: p for p in sorted((ROOT / "examples").glob("*.txt"))})
    return found


def _default_texts(n: int) -> list[str]:
    """The ``n`` shortest texts (the compile and the full-context runs stay cheap)."""
    paths = _paths()
    return sorted(paths, key=lambda name: (paths[name].stat().st_size, name))[:n]


def _compile(model, tok, names: list[str], query: str, update: str, folder: Path) -> list[dict]:
    """Per text: its patch, ``lora.gguf``, and the Transformers side of check 2's bound."""
    paths, out = _paths(), []
    for name in names:
        patch = ctxc.compile(
            model, tok, context=paths[name].read_text(), query=query, update=update
        )
        patch = patch.patch
        path = folder / f"{name}.lora.gguf"
        write_gguf_lora(model, patch, path)
        full = reference_logits(model, patch)  # plain forward, context + query
        with patch.applied(model, check=False):
            (patched,) = torch_logits(model, [torch.tensor([patch.meta.query_ids])])
        out.append(
            {
                "name": name,
                "context": list(patch.meta.context_ids),
                "query": list(patch.meta.query_ids),
                "lora": path,
                "full_t": full,
                "own_t": fidelity(patched, full).max_abs_logit_diff,
            }
        )
        print(f"compiled {name} ({len(patch.meta.context_ids)} tokens)", flush=True)
    return out


def _requests(n: int, rounds: int) -> list[int | None]:
    """A warm-up request without an adapter (left out of the costs: the first decode builds
    llama.cpp's graph), then ``rounds`` times: the query twice without an adapter, each adapter
    in turn (every request a switch), each adapter twice in a row (the second keeps it)."""
    order: list[int | None] = [None]
    for _ in range(rounds):
        order += [None, None, *range(n)]
        order += [i for i in range(n) for _ in range(2)]
    return order


def _references(base: Path, ctxs: list[dict], alone_t: torch.Tensor, threads: int) -> dict:
    """llama.cpp's own full-context runs on ``base`` and its floors against Transformers."""
    k = len(ctxs[0]["query"])
    jobs = [{"model": base, "lora": None, "ids": c["context"] + c["query"], "k": k} for c in ctxs]
    jobs.append({"model": base, "lora": None, "ids": ctxs[0]["query"], "k": k})
    *fulls, alone = llama_cpp_logits(jobs, base.name, threads=threads)
    return {
        "fulls": fulls,
        "floor": float((alone - alone_t).abs().max()),
        "full_vs_t": [
            float((f - c["full_t"]).abs().max()) for f, c in zip(fulls, ctxs, strict=True)
        ],
        "control": [fidelity(alone, f).max_abs_logit_diff for f in fulls],
    }


def _rows(
    base_name: str, ctxs: list[dict], refs: dict, order: list, runs: list[LlamaCppSwitching]
) -> list[dict]:
    """One row per context: its worst request (over ``runs``, whose requests are ``order``)
    against its own full-context run, the nearest other context, the bound of check 2."""
    rows = []
    for i, c in enumerate(ctxs):
        own, nearest, top1 = 0.0, float("inf"), True
        for got in (g for run in runs for g, a in zip(run.logits, order, strict=True) if a == i):
            f = fidelity(got, refs["fulls"][i])
            own, top1 = max(own, f.max_abs_logit_diff), top1 and f.top1_match
            for j, other in enumerate(refs["fulls"]):
                if j != i:
                    nearest = min(nearest, float((got - other).abs().max()))
        scale = max(refs["floor"], refs["full_vs_t"][i], LLAMA_CPP_MIN_FLOOR)
        runtime_only = LLAMA_CPP_FACTOR * scale
        bound = runtime_only + c["own_t"]
        rows.append(
            {
                "text": c["name"],
                "tokens": len(c["context"]),
                "base": base_name,
                "own": own,
                "nearest_other": nearest,
                "top1": top1,
                "floor": refs["floor"],
                "full_vs_transformers": refs["full_vs_t"][i],
                "own_transformers": c["own_t"],
                "bound": bound,
                "passes": own <= bound,
                # The bound an exact rule (own-T about 1e-5) must meet: llama.cpp's part alone.
                "runtime_bound": runtime_only,
                "within_runtime_bound": own <= runtime_only,
                "control": refs["control"][i],
            }
        )
    return rows


def _median_ms(values) -> float | None:
    values = list(values)
    return 1e3 * statistics.median(values) if values else None


def _costs(base_name: str, order: list, shared: LlamaCppSwitching, fresh: LlamaCppSwitching):
    """The switch cost on one base, medians in ms (the warm-up request left out)."""
    steps = list(zip(order, shared.switched, shared.set_s, shared.decode_s, strict=True))[1:]
    return {
        "base": base_name,
        "switch_set_ms": _median_ms(s for a, w, s, _ in steps if w and a is not None),
        "switch_decode_ms": _median_ms(d for a, w, _, d in steps if w and a is not None),
        "switch_total_ms": _median_ms(s + d for a, w, s, d in steps if w and a is not None),
        "keep_decode_ms": _median_ms(d for a, w, _, d in steps if not w and a is not None),
        "no_adapter_decode_ms": _median_ms(d for a, w, _, d in steps if a is None and not w),
        "clear_kv_ms": _median_ms(shared.context_s[1:]),
        "fresh_total_ms": _median_ms(
            c + s + d
            for a, c, s, d in list(
                zip(order, fresh.context_s, fresh.set_s, fresh.decode_s, strict=True)
            )[1:]
            if a is not None
        ),
        "adapter_load_ms": _median_ms(shared.load_s),
        "logits_shared_vs_fresh": max(
            float((a - b).abs().max()) for a, b in zip(shared.logits, fresh.logits, strict=True)
        ),
    }


def _serve(base: Path, base_name: str, ctxs: list[dict], alone_t, args) -> tuple[list, dict]:
    """Everything on one base: the references, both switching runs, their rows and costs."""
    refs = _references(base, ctxs, alone_t, args.threads)
    order = _requests(len(ctxs), args.rounds)
    k = len(ctxs[0]["query"])
    requests = [(a, ctxs[0]["query"], k) for a in order]
    adapters = [c["lora"] for c in ctxs]
    runs = [
        llama_cpp_switching(base, adapters, requests, fresh=fresh, threads=args.threads)
        for fresh in (False, True)
    ]
    rows = _rows(base_name, ctxs, refs, order, runs)
    costs = _costs(base_name, order, *runs)
    for r in rows:
        print(_line(r), flush=True)
    print(_cost_line(costs), flush=True)
    return rows, costs


def _line(r: dict) -> str:
    return (
        f"{r['base']:6} {r['text']:12} {r['tokens']:5d}  own {r['own']:9.3g}  bound "
        f"{r['bound']:9.3g} {'ok' if r['passes'] else 'OVER':4}  nearest other "
        f"{r['nearest_other']:8.3g}  top-1 {'match' if r['top1'] else 'MISS'}  "
        f"(floor {r['floor']:.3g}, full-vs-T {r['full_vs_transformers']:.3g}, own-T "
        f"{r['own_transformers']:.3g}, control {r['control']:.3g})"
    )


def _cost_line(c: dict) -> str:
    return (
        f"{c['base']}: switch = set {c['switch_set_ms']:.2f} + decode "
        f"{c['switch_decode_ms']:.1f} ms; keep: decode {c['keep_decode_ms']:.1f} ms; no adapter "
        f"{c['no_adapter_decode_ms']:.1f} ms; clear KV {c['clear_kv_ms']:.3f} ms; fresh "
        f"context per request {c['fresh_total_ms']:.1f} ms; adapter load "
        f"{c['adapter_load_ms']:.1f} ms; "
        f"shared vs fresh logits max {c['logits_shared_vs_fresh']:.3g}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--contexts", type=int, default=10, help="N: the N shortest texts")
    parser.add_argument("--texts", nargs="+", default=None, help="instead of --contexts")
    parser.add_argument("--query", default=QUERY)
    parser.add_argument("--update", default="lora")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp's and torch's")
    parser.add_argument("--rounds", type=int, default=1, help="times round the adapters")
    parser.add_argument("--no-q4", action="store_true", help="the F32 base only")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--results", type=Path, default=None, help="also write the tables here")
    args = parser.parse_args()
    reason = llama_cpp_unavailable()
    if reason is not None:
        raise SystemExit(f"llama.cpp cannot run: {reason}")
    names = args.texts or _default_texts(args.contexts)
    if len(names) < 2 or len(set(names)) != len(names):
        raise SystemExit("need two or more distinct texts")
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    model, tok = ctxc.load_model(args.model)
    rows, costs = [], []
    with tempfile.TemporaryDirectory(prefix="ctxc-llama-adapters-") as tmp:
        ctxs = _compile(model, tok, names, args.query, args.update, Path(tmp))
        (alone_t,) = torch_logits(model, [torch.tensor([ctxs[0]["query"]])])
        if any(c["query"] != ctxs[0]["query"] for c in ctxs):
            raise SystemExit("the query's ids differ between contexts")
        base = Path(tmp) / "base.gguf"
        write_gguf(model, tok, base)
        bases = [(base, "F32")]
        q4 = source_gguf(model)
        if q4 is not None and not args.no_q4:
            bases.append((q4, "Q4_K_M"))
        for path, base_name in bases:
            got_rows, got_costs = _serve(path, base_name, ctxs, alone_t, args)
            rows += got_rows
            costs.append(got_costs)
    meta = {"update": args.update, "query": args.query, "runtime": llama_cpp_version()}
    if args.json is not None:
        args.json.write_text(json.dumps({**meta, "rows": rows, "costs": costs}, indent=1) + "\n")
    if args.results is not None:
        write_table(
            args.results,
            f"{len(names)} lora.gguf adapters switched on one llama.cpp model",
            invocation("benchmarks.fidelity.llama_cpp_adapters"),
            _HEADER,
            [_cells(r) for r in rows],
            _notes(meta, costs),
        )


_HEADER = [
    "base",
    "text (tokens)",
    "own",
    "bound",
    "2x floor",
    "nearest other",
    "top-1",
    "floor",
    "full-vs-T",
    "own-T",
    "control",
]


def _cells(r: dict) -> list[str]:
    own = f"{r['own']:.3g}"
    checked = r["base"] == "F32"  # Q4_K_M: reported beside its floor, not checked
    return [
        r["base"],
        f"{r['text']} ({r['tokens']})",
        own if r["passes"] or not checked else f"**{own}**",
        f"{r['bound']:.3g}" if checked else f"({r['bound']:.3g})",
        f"{r['runtime_bound']:.3g}",
        f"{r['nearest_other']:.3g}",
        "match" if r["top1"] else "MISS",
        f"{r['floor']:.3g}",
        f"{r['full_vs_transformers']:.3g}",
        f"{r['own_transformers']:.3g}",
        f"{r['control']:.3g}",
    ]


def _notes(meta: dict, costs: list[dict]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3g}"

    cost_rows = [
        [
            c["base"],
            ms(c["switch_set_ms"]),
            ms(c["switch_decode_ms"]),
            ms(c["keep_decode_ms"]),
            ms(c["no_adapter_decode_ms"]),
            ms(c["fresh_total_ms"]),
            ms(c["adapter_load_ms"]),
            f"{c['logits_shared_vs_fresh']:.3g}",
        ]
        for c in costs
    ]
    cost_header = [
        "base",
        "set_adapters (ms)",
        "decode after a switch (ms)",
        "decode, adapter kept (ms)",
        "decode, no adapter (ms)",
        "fresh context per request (ms)",
        "adapter load (ms)",
        "shared vs fresh context, max |dlogit|",
    ]
    return (
        f"{meta['runtime']}, `--update {meta['update']}`, query {json.dumps(meta['query'])}, "
        "all adapters loaded once on one model. `own`: max |dlogit| over the query rows, the "
        "worst of the requests with that context's adapter (one context switched per request, "
        "and a fresh context per request), against llama.cpp's own full-context run of that "
        "context on the same base; `nearest other`: the smallest distance of those requests "
        "from another context's full-context run; `bound`: check 2's `2 x max(floor, "
        "full-vs-T, 1e-5) + own-T` (`2x floor`: its first term alone, the bound of a rule exact "
        "in Transformers; "
        "`floor`: llama.cpp vs Transformers, unpatched, query alone; `full-vs-T`: the "
        "same on context + query; `own-T`: the torch patched model vs the full-context forward); "
        "bold: over it; on Q4_K_M in brackets, reported only. `control`: the base fed the query "
        "alone.\n\nSwitch cost (medians; one context whose KV cache is cleared between "
        "requests, unless said):\n\n" + table(cost_header, cost_rows)
    )


if __name__ == "__main__":
    main()
