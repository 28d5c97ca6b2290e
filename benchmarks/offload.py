"""A compile of the bundled Gemma 3 270M offloaded to disk, against the in-memory compile.

Runs ``ctxc compile`` twice, each in its own process: in memory, and with ``--device-map auto
--max-memory cpu=SIZE`` (accelerate offloads what does not fit to disk). Prints the model's
size, each process's peak resident memory (VmHWM: anonymous and file-backed pages) beside
its memory after the imports and after loading the tokenizer alone (Gemma 3's 262k-entry
tokenizer is ~330 MB by itself, not weights), whether the two patches are byte-identical, and
the fidelity of each emitted ``model/`` (reloaded, placed as compiled) against the full context,
with the unpatched control beside it.

    python benchmarks/offload.py [--context examples/medium.txt] [--max-memory cpu=100MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status_mib(key: str) -> float:
    """A ``/proc/self/status`` figure (VmRSS, VmHWM, ...) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(argv: list[str], out: str) -> None:
    """In a fresh process: note memory after the imports, run ``ctxc`` with ``argv``."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from ctxc.cli import main

    imports = _status_mib("VmRSS")
    rc = main(argv)
    Path(out).write_text(json.dumps({"rc": rc, "imports": imports, "peak": _status_mib("VmHWM")}))


def tokenizer_child(out: str) -> None:
    """In a fresh process: memory after the imports, then after loading the tokenizer alone."""
    import torch  # noqa: F401
    from transformers import AutoTokenizer

    from ctxc.models import bundled_model_dir

    directory = bundled_model_dir()
    before = _status_mib("VmRSS")
    AutoTokenizer.from_pretrained(str(directory))
    Path(out).write_text(json.dumps({"tokenizer": _status_mib("VmRSS") - before}))


def _run(args: list[str], tmp: Path, name: str) -> dict:
    figures = tmp / f"{name}.json"
    cmd = [sys.executable, __file__, "--child", str(figures), "--", *args]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(figures.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", default=str(ROOT / "examples" / "medium.txt"))
    parser.add_argument("--max-memory", default="cpu=100MiB")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-child", default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        child([a for a in rest if a != "--"], args.child)
        return
    if args.tokenizer_child:
        tokenizer_child(args.tokenizer_child)
        return
    import ctxc

    model, _ = ctxc.load_model(None)
    size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    del model
    with tempfile.TemporaryDirectory(prefix="ctxc-offload-bench-") as name:
        tmp = Path(name)
        common = ["compile", "--context", args.context, "--emit", "torch"]
        mem = _run([*common, "--out", str(tmp / "mem")], tmp, "mem")
        placed = ["--device-map", "auto", "--max-memory", args.max_memory]
        off = _run([*common, "--out", str(tmp / "off"), *placed], tmp, "off")
        subprocess.run([sys.executable, __file__, "--tokenizer-child", str(tmp / "t.json")])
        tokenizer = json.loads((tmp / "t.json").read_text())["tokenizer"]
        same = (tmp / "mem" / "patch.safetensors").read_bytes() == (
            tmp / "off" / "patch.safetensors"
        ).read_bytes()
        reports = {k: json.loads((tmp / k / "report.json").read_text()) for k in ("mem", "off")}
    print(f"model: bundled Gemma 3 270M, float32, {size:.0f} MiB of parameters")
    print(f"tokenizer alone: {tokenizer:.0f} MiB resident")
    runs = (("mem", mem, "in memory"), ("off", off, f"offloaded ({args.max_memory})"))
    for key, fig, label in runs:
        r = reports[key]
        work = fig["peak"] - fig["imports"] - tokenizer
        print(
            f"{label:28} peak {fig['peak']:6.0f} MiB (imports {fig['imports']:.0f}; "
            f"peak - imports - tokenizer {work:.0f} MiB = {work / size:.2f} x model) "
            f"placement {r['placement']}"
        )
        print(
            f"{'':28} emitted model/ reloaded: max |logit diff| {r['max_abs_logit_diff']:.3g}, "
            f"top-1 {r['top1_match']}; in memory {r['in_memory']['max_abs_logit_diff']:.3g}; "
            f"control {r['control']['max_abs_logit_diff']:.3g}; compile "
            f"{sum(r['timings'].values()):.1f} s"
        )
    print(f"patch.safetensors byte-identical: {same}")


if __name__ == "__main__":
    main()
