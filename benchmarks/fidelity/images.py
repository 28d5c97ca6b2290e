"""Image contexts (issue 12): fidelity and cost on tiny random VLMs, or on a real one.

For each case: compile the image (+ text) context, write ``DIR/model`` with the torch backend,
reload it with plain ``AutoModelForImageTextToText``, feed it the query ids alone and compare with
the model's own Transformers forward fed the processor's images and text plus the query. Prints
max |logit diff|, total variation and top-1 of the emitted model, the unpatched control beside
it, the full run's agreement with the model's own forward, and the compile's seconds.

    python -m benchmarks.fidelity.images      # tiny Gemma 3, LLaVA and PaliGemma (built here)
    python -m benchmarks.fidelity.images --model DIR --image IMG [--context TEXT] [--query TEXT]

No real vision-language weights are bundled: ``--model`` takes a local folder (for example
``hf download google/gemma-3-4b-it`` where a network is available).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText
from transformers.utils import logging as hf_logging

import ctxc
from ctxc.backends.torch.model import emit_torch
from ctxc.core.metrics import fidelity
from ctxc.models.images import encode_image_context
from ctxc.models.vlm import load_processor

ROOT = Path(__file__).resolve().parents[2]


def measure(model, processor, image: Path, context: str, query: str | None, out: Path) -> dict:
    """One compile; the emitted model reloaded, its control, the full run against the model."""
    start = time.perf_counter()
    result = ctxc.compile(model, processor, context=context, query=query, images=[image])
    seconds = time.perf_counter() - start
    encoded = encode_image_context(model, processor, context, [image], query)
    k = len(encoded.query_ids)
    with torch.no_grad():
        want = model(**encoded.inputs).logits[0, -k:].float()  # the model's own forward
    emit_torch(model, processor, result.patch, out)
    reloaded = AutoModelForImageTextToText.from_pretrained(str(out), dtype=model.dtype).eval()
    q = torch.tensor([encoded.query_ids])
    with torch.no_grad():
        got = reloaded(input_ids=q).logits[0].float()
        control = model(input_ids=q).logits[0].float()
    return {
        "emitted": fidelity(got, want),
        "control": fidelity(control, want),
        "full_run_vs_model": result.report.images["full_run_vs_model"],
        "image_tokens": result.report.images["image_tokens"],
        "seconds": seconds,
    }


def _row(name: str, m: dict) -> str:
    e, c = m["emitted"], m["control"]
    return (
        f"{name:<28} {e.max_abs_logit_diff:9.2e} {e.total_variation:9.2e} "
        f"{'yes' if e.top1_match else 'no':>4}  {c.max_abs_logit_diff:9.3g} "
        f"{'yes' if c.top1_match else 'no':>4}  {m['full_run_vs_model']:9.2e} "
        f"{m['image_tokens']:5d} {m['seconds']:7.1f}"
    )


def _tiny_cases(work: Path) -> list[tuple[str, object, object, Path, str, str | None]]:
    from testbed.tiny_vlms import build_vlm, make_image

    image = make_image(work / "a.png", 1)
    cases = []
    for family in ("gemma3", "llava", "paligemma"):
        model, _ = ctxc.load_model(str(build_vlm(family, work / family)))
        processor = load_processor(model)
        cases.append((f"tiny {family}, image + text", model, processor, image, "w5 w6 w7", "w20"))
    gemma, pali = cases[0], cases[2]
    cases.append(("tiny gemma3, image only", gemma[1], gemma[2], image, "", None))
    # PaliGemma attends both ways over the prefix and over a query fed alone: three tokens
    cases.append(("tiny paligemma, 3-token query", pali[1], pali[2], image, "w5 w6 w7", QUERY3))
    return cases


QUERY3 = "w20 w21 w22"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local vision-language model folder (default: tiny)")
    parser.add_argument("--image", type=Path, help="the image, with --model")
    parser.add_argument("--context", default="Describe this picture.", help="text after it")
    parser.add_argument("--query", default=None, help="query text (default: last token)")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.model:
            model, _ = ctxc.load_model(args.model, args.dtype)
            cases = [
                (args.model, model, load_processor(model), args.image, args.context, args.query)
            ]
        else:
            cases = _tiny_cases(work)
        print(
            f"{'case':<28} {'max|dl|':>9} {'TV':>9} {'top1':>4}  {'control':>9} {'top1':>4}  "
            f"{'full/model':>9} {'imgtk':>5} {'compile s':>7}"
        )
        for i, (name, model, processor, image, context, query) in enumerate(cases):
            m = measure(model, processor, image, context, query, work / f"out{i}")
            print(_row(name, m), flush=True)


if __name__ == "__main__":
    main()
