"""The lora rule and the serving artefacts on a real model (issue 14).

For each example context: compile with the ``stable`` rule and with the ``lora`` rule (linear
weights only), and print each one's fidelity at the query against the original model fed
context + query (max and mean |logit diff|, total variation, top-1) beside the unpatched
control, with the lora rule's per-block misses (``unreached_norm``). With ``--gguf``, the
lora patch is also written as ``model.gguf`` (F32, reloaded by Transformers' GGUF loader),
``lora/`` (PEFT, vLLM's rules) and ``lora.gguf``, and their figures are printed.

    python -m benchmarks.fidelity.serving [--model M] [--texts short medium long] [--gguf]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import ctxc
from ctxc.core.metrics import Fidelity

ROOT = Path(__file__).resolve().parents[2]


def _row(what: str, fid: Fidelity, extra: str = "") -> str:
    return (
        f"  {what:26} max {fid.max_abs_logit_diff:9.3g}  mean {fid.mean_abs_logit_diff:9.3g}  "
        f"TV {fid.total_variation:9.3g}  top-1 {'match' if fid.top1_match else 'MISMATCH':8} "
        f"{extra}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--texts", nargs="+", default=["short", "medium", "long"])
    parser.add_argument("--gguf", action="store_true")
    args = parser.parse_args()
    model, tokenizer = ctxc.load_model(args.model)
    for name in args.texts:
        text = (ROOT / "examples" / f"{name}.txt").read_text()
        results, seconds = {}, {}
        for rule in ("stable", "lora"):
            clock = time.perf_counter()
            results[rule] = ctxc.compile(model, tokenizer, context=text, update=rule)
            seconds[rule] = time.perf_counter() - clock
        rep = results["lora"].report
        print(f"{name}: {len(rep.context_ids) + len(rep.query_ids)} tokens")
        print(_row("unpatched control", rep.control))
        for rule, res in results.items():
            print(_row(f"{rule} rule, emitted", res.report.emitted, f"{seconds[rule]:.1f} s"))
        misses = [b.unreached_norm or 0.0 for b in rep.blocks]
        print("  lora unreached_norm per block: " + " ".join(f"{m:.3g}" for m in misses))
        if args.gguf:
            _serving(model, tokenizer, results["lora"])


def _serving(model, tokenizer, result) -> None:
    from ctxc.backends.gguf.lora import emit_gguf_lora
    from ctxc.backends.gguf.model import emit_gguf
    from ctxc.backends.peft.lora_adapter import emit_lora

    with tempfile.TemporaryDirectory() as tmp:
        out, full = Path(tmp), result.full_logits
        _, g = emit_gguf(model, result.patch, out, full=full, tokenizer=tokenizer)
        print(
            _row("model.gguf F32, reloaded", g.reloaded, f"vs patched {g.reloaded_vs_patched:.3g}")
        )
        _, lo = emit_lora(model, result.patch, out, full=full)
        print(_row("lora/ as loaded (PEFT)", lo.peft.lora, f"vLLM r={lo.vllm.r}"))
        _, gl = emit_gguf_lora(model, result.patch, out, full=full)
        print(_row("lora.gguf applied", gl.applied, f"vs patched {gl.applied_vs_patched:.3g}"))


if __name__ == "__main__":
    main()
