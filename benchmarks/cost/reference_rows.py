"""The reference's LM head at the query rows alone against the default forward's every row.

Every artefact check and every bake figure compares with the unpatched model fed context +
query (``ctxc.backends.reference.reference_logits``). The default forward applies the LM head to
every position, [n, vocab] float32 logits, to read the last k; ``head_at_query_rows`` computes
the k rows alone, bit for bit as the long call gives them. For each length ``n`` this runs both
ways, each in a fresh subprocess (the bundled model loaded, its weights copied into anonymous
memory and warmed up, the peak resident memory reset: ``benchmarks/cost/long_context.py``),
and prints the seconds, the peak above the loaded model, and whether the k rows are the same bits.

    python -m benchmarks.cost.reference_rows [--lengths 1024 3500] [--k 32] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.utils import logging as hf_logging

import ctxc
from benchmarks.cost.long_context import _status, long_ids
from ctxc.backends.reference import head_at_query_rows, torch_logits
from ctxc.frontend.trace import no_cache

_GIB = 1024**3
WAYS = ("every", "rows")


def _child(way: str, n: int, k: int, threads: int | None, out: Path) -> None:
    if threads:
        torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()
    model, tokenizer = ctxc.load_model(None)
    with torch.no_grad():  # weights in anonymous memory (long_context.py's docstring)
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.clone()
    ids = torch.tensor([long_ids(tokenizer, n)])
    rows = head_at_query_rows(model, k) if way == "rows" else _plain()
    with no_cache(model), rows:
        torch_logits(model, [ids[:, :16]])  # warm-up
        loaded = _status("self", "VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        start = time.perf_counter()
        logits = torch_logits(model, [ids])[0][-k:].clone()  # [k, vocab]
        seconds = time.perf_counter() - start
    peak = _status("self", "VmHWM")
    save_file({"logits": logits}, str(out.with_suffix(".safetensors")))
    out.write_text(json.dumps({"seconds": seconds, "above_loaded_gib": (peak - loaded) / _GIB}))


class _plain:
    def __enter__(self) -> bool:
        return False

    def __exit__(self, *exc) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 3500])
    parser.add_argument("--k", type=int, default=32, help="query rows (a bake's first fit query)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.length, args.k, args.threads, args.out)
        return 0
    print("| n | k | way | seconds | peak above the loaded model GiB | same bits |")
    print("|---:|---:|---|---:|---:|---|")
    with tempfile.TemporaryDirectory(prefix="ctxc-ref-") as name:
        for n in args.lengths:
            got = {}
            for way in WAYS:
                out = Path(name) / f"{way}-{n}.json"
                cmd = [sys.executable, "-m", "benchmarks.cost.reference_rows", "--child", way,
                       "--length", str(n), "--k", str(args.k), "--out", str(out)]  # fmt: skip
                if args.threads:
                    cmd += ["--threads", str(args.threads)]
                subprocess.run(cmd, check=True)
                got[way] = json.loads(out.read_text())
                got[way]["logits"] = load_file(str(out.with_suffix(".safetensors")))["logits"]
            same = torch.equal(got["every"]["logits"], got["rows"]["logits"])
            for way in WAYS:
                row = got[way]
                print(f"| {n} | {args.k} | {way} | {row['seconds']:.2f} | "
                      f"{row['above_loaded_gib']:.2f} | {same} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
