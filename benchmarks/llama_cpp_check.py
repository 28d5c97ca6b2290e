"""Run ctxc's GGUF artefacts in llama.cpp itself, through llama-cpp-python (issue 14).

Compiles a context (default: the bundled Gemma 3 270M, examples/short.txt), writes the
patched ``model.gguf`` and, for a patch of the ``lora`` rule, the unpatched ``base.gguf`` and
``lora.gguf``; loads each in ``llama_cpp.Llama`` (CPU), feeds the query ids alone and prints
max |logit diff|, total variation and top-1 against the torch model fed context + query, beside
the torch patched model's figure and the unpatched control's.

    pip install llama-cpp-python   # builds llama.cpp from source with cmake (10+ minutes)
    python benchmarks/llama_cpp_check.py [--model M] [--text short] [--update stable|lora]
        [--transformers]

Not part of CI: llama-cpp-python is not a ctxc dependency.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

import ctxc
from ctxc.backends.gguf_lora import emit_gguf_lora
from ctxc.backends.gguf_model import emit_gguf, write_gguf
from ctxc.metrics import Fidelity, fidelity

ROOT = Path(__file__).resolve().parents[1]


def _row(what: str, fid: Fidelity) -> str:
    return (
        f"  {what:34} max {fid.max_abs_logit_diff:9.3g}  mean {fid.mean_abs_logit_diff:9.3g}  "
        f"TV {fid.total_variation:9.3g}  top-1 {'match' if fid.top1_match else 'MISMATCH'}"
    )


def _llama_cpp_logits(path: Path, ids: list[int], lora: Path | None = None) -> torch.Tensor:
    """llama.cpp's logits [k, vocab] for ``ids`` fed alone (no BOS added)."""
    from llama_cpp import Llama

    kwargs = {"lora_path": str(lora)} if lora is not None else {}
    llm = Llama(
        model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2, **kwargs
    )
    llm.eval(ids)
    rows = np.array(llm.scores[: len(ids)], dtype=np.float32)  # [k, vocab]
    del llm
    return torch.from_numpy(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--text", default="short")
    parser.add_argument("--update", default="stable")
    parser.add_argument(
        "--transformers", action="store_true", help="also reload it with Transformers (minutes)"
    )
    args = parser.parse_args()
    model, tokenizer = ctxc.load_model(args.model)
    text = (ROOT / "examples" / f"{args.text}.txt").read_text()
    result = ctxc.compile(model, tokenizer, context=text, update=args.update)
    full, ids = result.full_logits, result.patch.meta.query_ids
    print(f"{args.text}, {args.update} rule, query {ids}")
    print(_row("unpatched control (torch)", result.report.control))
    print(_row("patched model (torch)", result.report.emitted))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if args.transformers:
            _, figures = emit_gguf(model, result.patch, out, full=full, tokenizer=tokenizer)
            print(_row("model.gguf reloaded by Transformers", figures.reloaded))
        else:
            with result.patch.applied(model):
                write_gguf(model, tokenizer, out / "model.gguf")
        got = _llama_cpp_logits(out / "model.gguf", ids)
        print(_row("model.gguf in llama.cpp", fidelity(got, full)))
        write_gguf(model, tokenizer, out / "base.gguf")
        base = _llama_cpp_logits(out / "base.gguf", ids)
        print(_row("unpatched base.gguf in llama.cpp", fidelity(base, full)))
        if args.update == "lora":
            emit_gguf_lora(model, result.patch, out, full=full)
            got = _llama_cpp_logits(out / "base.gguf", ids, lora=out / "lora.gguf")
            print(_row("base.gguf + lora.gguf in llama.cpp", fidelity(got, full)))


if __name__ == "__main__":
    main()
