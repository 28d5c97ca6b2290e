"""One coverage-matrix entry, run in this process: build its tiny model, compile, record.

:func:`run_entry` never raises: the record says exact / inexact (the emitted model's figure beside
the unpatched control's), refused (the compiler's reasons), failed (at which stage) or out of
scope. ``benchmarks/coverage/matrix.py`` runs each entry in a process of its own.
"""

from __future__ import annotations

import os
import re
import time
import traceback
from collections import Counter
from pathlib import Path

from ctxc.core.thresholds import EXACT_ATOL
from testbed.coverage.configs import SEED, VOCAB, build_model
from testbed.coverage.entries import Entry

__all__ = ["FAINT", "N_IDS", "ROOT", "TOL", "cell", "faint", "first_line", "run_entry"]

ROOT = Path(__file__).resolve().parents[2]
TOL = EXACT_ATOL  # what exact means: compiler/core/thresholds.py
# Context 23 random ids + a one-token query, as the CLI's default query (the context's last token).
N_IDS = 24
# Where the next rung's reason starts in an UntraceableError's text: each begins with the rung's
# name (compiler/frontend/ladder.py: build_frontend and _static join them with "; ").
_RUNG = re.compile(r"; (?=(?:dynamic|bounded|static|specialised)\b)")
# A rung's reason in the record: its first sentence (a full stop and a space end it), this long
# at most (the branch leads the reasons; a rung's reason says why that rung could not help).
_SENTENCE = re.compile(r"\.\s+")
_RUNG_CHARS = 180


def run_entry(entry: Entry, seed: int = SEED) -> dict:
    """Build and compile ``entry`` in this process; never raises.

    Args:
        entry: the class to compile.
        seed: seed of the weights and of the random context.

    Returns:
        the result record (``status`` one of exact, inexact, refused, failed, out of scope).
    """
    rec: dict = {"family": entry.family, "cls": entry.cls, "kind": entry.kind}
    if entry.scope:
        return {**rec, "status": "out of scope", "reason": entry.scope}
    # The update rule: ``stable`` unless ``matrix.py --update`` set it for the forked children.
    update = os.environ.get("CTXC_COVERAGE_UPDATE", "stable")
    if update != "stable":
        rec["update"] = update
    start = time.perf_counter()
    stage = "config"
    try:
        import torch

        import ctxc
        from ctxc.core.errors import SolveError, UnpatchableError, UntraceableError

        stage = "build"
        model, rec["experts"] = build_model(entry, seed)
        vocab = model.get_input_embeddings().weight.shape[0]
        gen = torch.Generator().manual_seed(seed + 1)
        ids = torch.randint(4, min(vocab, VOCAB), (N_IDS,), generator=gen).tolist()
        stage = "forward"  # a failure here is the tiny config's, not ctxc's
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
        stage = "compile"
        try:
            rep = ctxc.compile(
                model, None, context_ids=ids[:-1], query_ids=ids[-1:], update=update
            ).report
        except UntraceableError as exc:  # the frontend's refusal: its first reason leads
            rec.update(status="refused", error=type(exc).__name__, **_untraceable(exc))
        except (UnpatchableError, SolveError) as exc:
            rec.update(_refusal(model, exc))
            stage = "compile --skip-unpatchable"
            try:  # what patching the rest reaches, for the record
                rep = ctxc.compile(
                    model,
                    None,
                    context_ids=ids[:-1],
                    query_ids=ids[-1:],
                    skip_unpatchable=True,
                    update=update,
                ).report
                rec["skip_unpatchable"] = _figures(rep)
            except Exception as exc2:
                rec["skip_unpatchable"] = {"error": first_line(exc2)}
        else:
            rec.update(_figures(rep))
            exact = rep.emitted.max_abs_logit_diff <= TOL and not rep.rejections
            rec["status"] = "exact" if exact else "inexact"
        rec["blocks"] = _block_kinds(model)
    except Exception as exc:  # the record says what broke, at which stage
        rec.update(
            status="failed",
            stage=stage,
            error=type(exc).__name__,
            message=first_line(exc),
            where=_where(exc),
        )
    rec["seconds"] = round(time.perf_counter() - start, 2)
    return rec


def _figures(rep) -> dict:
    e, c = rep.emitted, rep.control
    return {
        "max_abs_logit_diff": e.max_abs_logit_diff,
        "top1_match": bool(e.top1_match),
        "control_max_abs_logit_diff": c.max_abs_logit_diff,
        "solver_max_abs_logit_diff": rep.patched.max_abs_logit_diff,
        "patched_blocks": sum(b.patched for b in rep.blocks),
        "rejections": list(rep.rejections),
        "frontend": rep.frontend,
    }


def _untraceable(exc) -> dict:
    """The frontend's reason (the data-dependent branch) and each rung's, its first sentence."""
    branch, *rungs = _RUNG.split(str(exc).removeprefix("every export rung failed: "))
    return {"reasons": ["export: " + branch.split("; ", 1)[0]], "rungs": [_brief(r) for r in rungs]}


def _brief(text: str) -> str:
    """A rung's reason up to its first full stop (torch's advice follows), clipped at a word."""
    text = _SENTENCE.split(text.strip().splitlines()[0] if text.strip() else "", maxsplit=1)[0]
    text = text.rstrip(" .")
    if len(text) <= _RUNG_CHARS:
        return text
    return text[:_RUNG_CHARS].rsplit(" ", 1)[0] + "…"


def _refusal(model, exc) -> dict:
    from ctxc.core.errors import SolveError

    if isinstance(exc, SolveError):
        reasons = [f"{exc.block}: {exc.reason}"]
    else:
        reasons = [str(exc)]
        try:  # the locator's reasons one by one (the error joins them)
            from ctxc.store.traced import traced_blocks

            rejections = traced_blocks(model)[1].rejections
            if rejections:
                reasons = [str(r) for r in rejections]
        except Exception:
            pass
    return {"status": "refused", "error": type(exc).__name__, "reasons": reasons}


def _block_kinds(model) -> dict:
    """Count of located blocks by shape (output control, parallel, trailing norm, gain, ...)."""
    try:
        from ctxc.store.traced import traced_blocks

        blocks = traced_blocks(model)[1]
    except Exception as exc:
        return {"error": first_line(exc)}
    kinds: Counter[str] = Counter()
    for b in blocks.blocks:
        tags = [b.output_control]
        if b.parallel:
            tags.append("parallel")
        if b.norm is not None:
            tags.append("post-norm")
        if b.trailing_norm:
            tags.append("post-LN")
        if b.gain != 1.0:
            tags.append("gain")
        if b.others:
            tags.append("shared")
        kinds["+".join(tags)] += 1
    return {"count": len(blocks.blocks), "kinds": dict(kinds), "rejected": len(blocks.rejections)}


def first_line(exc: BaseException) -> str:
    """The message's first line; with the next when the first only introduces it (``...:``)."""
    text = [t.strip() for t in str(exc).strip().splitlines() if t.strip()]
    if len(text) > 1 and text[0].endswith(":"):
        text = [f"{text[0]} {text[1]}"]
    return (text[0] if text else "")[:300]


def _where(exc: BaseException) -> str:
    """The innermost frame of the traceback, as ``file:line`` under its package."""
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return ""
    frame = tb[-1]
    path = frame.filename
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{frame.lineno}"


# A control figure below this: the random model hardly sees the context (a vacuous "exact").
FAINT = 1e-2


def faint(r: dict) -> bool:
    """The unpatched control is already close: exactness says little about this model."""
    return r.get("control_max_abs_logit_diff", 1.0) <= FAINT


def _fmt(x) -> str:
    return "" if x is None else f"{x:.2g}"


def cell(r: dict) -> str:
    """The matrix's result cell of record ``r`` (also the progress line of a run)."""
    status = r["status"]
    if status in ("exact", "inexact"):
        control = _fmt(r["control_max_abs_logit_diff"])
        note = ", the context hardly matters" if faint(r) else ""
        return f"{status}: {_fmt(r['max_abs_logit_diff'])} (control {control}{note})"
    if status == "refused":
        text = "; ".join(r.get("reasons", []))
        if r.get("rungs"):  # every export rung failed: each one's reason, after the branch
            text += f" [rungs: {'; '.join(r['rungs'])}]"
        skip = r.get("skip_unpatchable", {})
        if "max_abs_logit_diff" in skip:
            text += f" [rest patched: {_fmt(skip['max_abs_logit_diff'])}]"
        return f"refused: {text}"
    if status == "failed":
        return f"failed ({r.get('stage', '')}): {r['error']}: {r.get('message', '')}"
    return f"out of scope: {r.get('reason', '')}"
