"""What a command-line user pays: whole-process timings of ``ctxc compile`` (issue 11).

Every figure is the wall time of a new process, as a user runs it:

* ``plain``: a script that imports torch and Transformers, loads the same converted model and
  its tokenizer with ``AutoModelForCausalLM.from_pretrained`` and runs one forward pass of the
  same full input (``tokenizer(context)``: ctxc's context + query when no query is given);
* ``ctxc cold``: ``ctxc compile --context FILE`` with an empty export cache (the process runs
  ``torch.export`` and stores the entry);
* ``ctxc warm``: the same command again (the export comes from the cache);

plain and warm ``--repeats`` times each, interleaved, their medians compared;

for each example text, then the many-contexts check: ``--contexts`` with N contexts in one
process against N separate ``ctxc compile`` processes (warm), each output folder compared with
the separate compile's (patch bytes, and every report figure but the timings).

The cold and warm runs use a private ``CTXC_CACHE`` that links the converted model of the real
cache (no conversion is repeated) and starts with no export entry. The many-contexts runs
write ``--emit peft`` (small adapters) by default: ``--emit torch`` writes a 1 GB model folder
per context.

    python -m benchmarks.cost.cli [--model SPEC] [--contexts 20] [--repeats 3] [--emit-batch peft]
        [--examples FILE ...] [--skip-examples] [--skip-batch] [--keep DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.txt"))

PLAIN = r"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, text = sys.argv[1], open(sys.argv[2], encoding="utf-8").read()
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
ids = torch.tensor([tok(text).input_ids])
with torch.no_grad():
    logits = model(input_ids=ids).logits
print(ids.shape[1], int(logits[0, -1].argmax()))
"""


def run(cmd: list[str], env: dict) -> float:
    """Wall seconds of ``cmd`` as a new process; its failure is fatal to the benchmark.

    Dirty pages are written back first (``hyperfine --prepare sync``): a compile writes a 1 GB
    ``model/`` folder, and without it the next timed process is throttled by the kernel's
    write-back of the previous one's files (warm runs measured 0.5-2 s slower that way).
    """
    os.sync()
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return seconds


def private_cache(real: Path, into: Path) -> Path:
    """A cache folder that shares the real one's converted models, with no export entry."""
    into.mkdir(parents=True)
    for name in ("converted", "gguf"):
        if (real / name).exists():
            (into / name).symlink_to(real / name, target_is_directory=True)
    return into


def ctxc_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ctxc.cli.app", "compile", *args]


def compile_into(out: Path, cmd: list[str], env: dict) -> float:
    """Wall seconds of the compile ``cmd`` into ``out``, a new folder each time (as a user
    compiling a context writes one): removing the last run's 1 GB model/ is not timed."""
    shutil.rmtree(out, ignore_errors=True)
    return run(cmd, env)


def examples(args, env: dict, work: Path, folder: Path) -> list[dict]:
    """Plain, cold and warm timings per example text."""
    rows = []
    for text in args.examples:
        cache = private_cache(Path(env["CTXC_REAL_CACHE"]), work / f"cache-{text.stem}")
        e = {**env, "CTXC_CACHE": str(cache)}
        model = ["--model", args.model] if args.model else []
        out = work / f"out-{text.stem}"
        cmd = ctxc_cmd("--context", str(text), *model, "--out", str(out))
        plain = [sys.executable, "-c", PLAIN, str(folder), str(text)]
        row = {"example": text.name, "ctxc cold": compile_into(out, cmd, e)}
        # Interleaved, so that a slow spell of the machine falls on both sides.
        runs = [(run(plain, e), compile_into(out, cmd, e)) for _ in range(args.repeats)]
        row["plain runs"], row["warm runs"] = ([round(x[i], 2) for x in runs] for i in (0, 1))
        row["plain"] = statistics.median(row["plain runs"])
        row["ctxc warm"] = statistics.median(row["warm runs"])
        report = json.loads((out / "report.json").read_text())
        row["tokens"] = len(report["context_ids"]) + len(report["query_ids"])
        row["emitted max diff"] = report["max_abs_logit_diff"]
        row["control max diff"] = report["control"]["max_abs_logit_diff"]
        row["timings"] = report["timings"]
        rows.append(row)
        print(
            f"{text.name:<12} {row['tokens']:>5} tok  plain {row['plain']:7.2f} s  "
            f"cold {row['ctxc cold']:7.2f} s ({row['ctxc cold'] / row['plain']:.2f}x)  "
            f"warm {row['ctxc warm']:7.2f} s ({row['ctxc warm'] / row['plain']:.2f}x)  "
            f"max|diff| {row['emitted max diff']:.3g} (control {row['control max diff']:.3g})",
            flush=True,
        )
    return rows


def contexts_file(path: Path, n: int) -> list[dict]:
    """``n`` different contexts: windows of the example texts' words, 20 to ~200 words."""
    words = " ".join(t.read_text(encoding="utf-8") for t in EXAMPLES).split()
    rows = []
    for i in range(n):
        start, length = (i * 37) % max(1, len(words) - 200), 20 + (i * 29) % 180
        rows.append({"context": " ".join(words[start : start + length]), "name": f"c{i:02d}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


# Wall times inside a report (the compile's stages, each emitter's check): never identical.
_TIMES = {"timings", "seconds", "check_seconds"}


def _figures(report):
    """``report`` without its wall times, at any depth: what must be identical."""
    if isinstance(report, dict):
        return {k: _figures(v) for k, v in report.items() if k not in _TIMES}
    if isinstance(report, list):
        return [_figures(v) for v in report]
    return report


def batch(args, env: dict, work: Path) -> dict:
    """One ``--contexts`` run against one process per context; folders compared."""
    rows = contexts_file(work / "contexts.jsonl", args.contexts)
    model = ["--model", args.model] if args.model else []
    emit = ["--emit", args.emit_batch]
    cmd = ctxc_cmd("--contexts", str(work / "contexts.jsonl"), *model, *emit)
    cache = Path(env["CTXC_CACHE"])
    entries = sorted(work.glob("cache-*/exports/*.safetensors"))
    if entries:  # an example's run stored the export: both sides start warm
        (cache / "exports").mkdir(exist_ok=True)
        shutil.copy2(entries[0], cache / "exports" / entries[0].name)
    else:  # one compile stores it
        (work / "one.txt").write_text(rows[0]["context"], encoding="utf-8")
        run(
            ctxc_cmd("--context", str(work / "one.txt"), *model, *emit, "--out", str(work / "w")),
            env,
        )
    batch_s = run([*cmd, "--out", str(work / "batch"), "--force"], env)
    separate_s, same = 0.0, 0
    for row in rows:
        (work / "one.txt").write_text(row["context"], encoding="utf-8")
        out = work / "single"
        one = ctxc_cmd("--context", str(work / "one.txt"), *model, *emit, "--out", str(out))
        separate_s += run([*one, "--force"], env)
        mine = work / "batch" / row["name"]
        patch_same = (mine / "patch.safetensors").read_bytes() == (
            out / "patch.safetensors"
        ).read_bytes()
        a, b = (json.loads((d / "report.json").read_text()) for d in (mine, out))
        same += patch_same and _figures(a) == _figures(b)
    result = {
        "contexts": len(rows),
        "one run": batch_s,
        "separate runs": separate_s,
        "identical folders": same,
    }
    print(
        f"{len(rows)} contexts: one --contexts run {batch_s:.1f} s, {len(rows)} separate "
        f"compiles {separate_s:.1f} s: {batch_s / separate_s:.3f} of it (target <= 0.333); "
        f"{same}/{len(rows)} folders identical (patch bytes, report figures)",
        flush=True,
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model spec (default: bundled Gemma)")
    parser.add_argument("--contexts", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="plain and warm runs (median)")
    parser.add_argument("--examples", type=Path, nargs="+", default=EXAMPLES)
    parser.add_argument("--emit-batch", default="peft", help="--emit of the many-contexts runs")
    parser.add_argument("--skip-examples", action="store_true")
    parser.add_argument("--skip-batch", action="store_true")
    parser.add_argument("--keep", type=Path, default=None, help="keep the work folder here")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()

    from ctxc.core.cache import cache_dir
    from ctxc.models.load import bundled_model_dir, load_model

    if args.model is None:
        folder = bundled_model_dir()
    else:  # a folder the plain script can load: the model's own, or its converted copy
        folder = Path(load_model(args.model)[0].name_or_path)
    work = args.keep or Path(tempfile.mkdtemp(prefix="ctxc-cli-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CTXC_REAL_CACHE": str(cache_dir())}
    print(f"model folder {folder}; {os.cpu_count()} CPUs; work folder {work}", flush=True)
    figures: dict = {}
    try:
        if not args.skip_examples:
            figures["examples"] = examples(args, env, work, folder)
        if not args.skip_batch:
            batch_env = {**env, "CTXC_CACHE": str(private_cache(cache_dir(), work / "cache-b"))}
            figures["batch"] = batch(args, batch_env, work)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
