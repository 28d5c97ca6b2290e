"""``ctxc bake`` and ``ctxc eval-bake``: thought patches from the command line (issue 13).

No torch import at module level (``ctxc --help`` stays fast).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ctxc.cli.options import FORCE, MODEL, BakeMethod
from ctxc.cli.output import output_folder
from ctxc.cli.progress import VERBOSE, say, stage, stage_progress
from ctxc.cli.support import load, parse_emit, read_context
from ctxc.core.errors import CtxcError

__all__ = ["bake_cmd", "eval_bake_cmd", "parse_rank"]


def parse_rank(rank: str) -> int | None:
    """``full`` -> None, else the integer (``BakeOptions`` checks its range); a CtxcError for
    anything else."""
    if rank.strip().lower() == "full":
        return None
    try:
        return int(rank)
    except ValueError:
        raise CtxcError(f"--rank {rank!r} is not an integer or 'full'") from None


def bake_cmd(
    context: Path = typer.Option(..., "--context", help="UTF-8 text file with the context."),
    queries: Path = typer.Option(None, "--queries", help="Fit queries, one per line."),
    samples: int = typer.Option(32, "--samples", help="K continuations sampled to fit on."),
    sample_tokens: int = typer.Option(32, "--sample-tokens", help="Tokens per sample."),
    rank: str = typer.Option("64", "--rank", help="Rank budget per matrix, or 'full'."),
    method: BakeMethod = typer.Option("fit", "--method", help="fit (closed form) or distill."),
    ridge: float = typer.Option(1.0, "--ridge", help="Relative ridge of the matrix fits."),
    seed: int = typer.Option(0, "--seed", help="Sampling and training seed."),
    steps: int = typer.Option(200, "--steps", help="distill: optimiser steps."),
    seconds: float = typer.Option(
        None, "--seconds", help="distill: train for this wall time instead of --steps."
    ),
    from_fit: bool = typer.Option(False, "--from-fit", help="distill: start from the fit."),
    eval_queries: Path = typer.Option(None, "--eval-queries", help="Held-out queries file."),
    eval_samples: int = typer.Option(8, "--eval-samples", help="Held-out samples (seed + 1)."),
    model: str | None = MODEL,
    emit: str = typer.Option("torch", "--emit", help="Comma list: torch, onnx, peft."),
    out_dir: Path = typer.Option(Path("ctxc-bake"), "--out", help="Output folder."),
    force: bool = FORCE,
    verbose: bool = VERBOSE,
) -> None:
    """Bake a context into one reusable patch, fitted over many queries (thought patch)."""
    from ctxc.bake.data import read_queries
    from ctxc.core.options import BakeOptions

    text = read_context(context)
    fit_texts = read_queries(queries) if queries is not None else None
    held_texts = read_queries(eval_queries) if eval_queries is not None else None
    opts = BakeOptions(  # validated here, once (the library names its fields, FLAGS the flags)
        samples=samples,
        sample_tokens=sample_tokens,
        rank=parse_rank(rank),
        method=method,
        ridge=ridge,
        seed=seed,
        distill_steps=steps,
        distill_seconds=seconds,
        distill_from_fit=from_fit,
    )
    if eval_samples < 0:
        raise CtxcError(f"--eval-samples must be at least 0 (got {eval_samples})")
    kinds = parse_emit(emit)
    with output_folder(out_dir, force, "bake") as tmp:
        from ctxc.bake.fit import bake
        from ctxc.core.report import write_report

        net, tokenizer = load(model, "float32")
        with stage_progress("baking", "fitting") as (on_stage, on_block):
            result = bake(
                net, tokenizer, text, fit_texts, options=opts, on_stage=on_stage, on_block=on_block
            )
        report = result.report
        report["figures"] = _figures(net, tokenizer, result, held_texts, eval_samples, seed)
        result.patch.save(tmp / "patch.safetensors")
        write_report(
            tmp, report, _emit(net, tokenizer, result.patch, tmp, kinds), under="artefacts"
        )
    for line in _summary(report["figures"]):
        say(line)
    say(f"wrote {out_dir}/")


def _figures(net, tokenizer, result, held_texts, eval_samples: int, seed: int) -> dict:
    """Fit-data and held-out figures of the patch beside the unpatched control's."""
    from ctxc.bake.evaluate import evaluate_many
    from ctxc.bake.fit import bake_data

    data = result.data
    sets = {"fit": data}
    ids = data.context_ids
    if eval_samples:
        sets["held_out_samples"] = bake_data(
            net, tokenizer, ids, None, eval_samples, 32, seed + 1, data.prefix
        )
    if held_texts:
        sets["held_out_queries"] = bake_data(net, tokenizer, ids, held_texts, 0, 32, seed)
    figures = {}
    for name, d in sets.items():
        gen = 0 if name == "fit" else 32
        stage(f"evaluating on {name}, {len(d.queries)} queries")
        patched, control = evaluate_many(net, [result.patch, None], d, gen)
        figures[name] = {"patched": patched.to_dict(), "control": control.to_dict()}
    return figures


def _emit(net, tokenizer, patch, tmp: Path, kinds: list[str]) -> dict:
    """The artefacts of ``kinds``, each checked as a compile's are (model/ reloaded too); their
    figures (at the first fit query) by kind."""
    from ctxc.backends import emit_checked

    return emit_checked(net, patch, tmp, kinds, on_stage=stage, tokenizer=tokenizer)


def _summary(figures: dict) -> list[str]:
    lines = []
    for name, pair in figures.items():
        p, c = pair["patched"], pair["control"]
        gen = (
            f", free generation {p['matched']:.1f} vs {c['matched']:.1f}" if p["gen_tokens"] else ""
        )
        lines.append(
            f"{name}: KL {p['kl']:.3g} (unpatched {c['kl']:.3g}), top-1 {p['top1']:.1%} "
            f"(unpatched {c['top1']:.1%}){gen}"
        )
    return lines


def eval_bake_cmd(
    folder: Path = typer.Argument(..., help="A ctxc bake output folder."),
    queries: Path = typer.Option(None, "--queries", help="Held-out queries, one per line."),
    samples: int = typer.Option(0, "--samples", help="Held-out samples to draw."),
    seed: int = typer.Option(1, "--seed", help="Seed of the held-out samples."),
    gen_tokens: int = typer.Option(32, "--gen-tokens", help="Greedy tokens per query."),
    model: str | None = MODEL,
    verbose: bool = VERBOSE,
) -> None:
    """Measure a baked patch on held-out queries against the model fed the context."""
    from ctxc.bake.data import read_queries
    from ctxc.patch import Patch

    texts = read_queries(queries) if queries is not None else None
    if not texts and samples < 1:
        raise CtxcError("give --queries FILE or --samples K (at least 1) to evaluate on")
    if gen_tokens < 0:
        raise CtxcError(f"--gen-tokens must be at least 0 (got {gen_tokens})")
    patch = Patch.load(folder)
    if not patch.meta.update.startswith("bake"):
        raise CtxcError(f"{folder} holds an exact compile's patch, not a baked one")
    from ctxc.bake.evaluate import evaluate_many
    from ctxc.bake.fit import bake_data

    net, tokenizer = load(model, patch.meta.dtype)
    patch.check(net)
    data = bake_data(net, tokenizer, patch.meta.context_ids, texts, max(samples, 0), 32, seed)
    stage(f"evaluating on {len(data.queries)} queries")
    patched, control = evaluate_many(net, [patch, None], data, gen_tokens)
    figures = {"held_out": {"patched": patched.to_dict(), "control": control.to_dict()}}
    for line in _summary(figures):
        say(line)
    say(json.dumps(figures))
