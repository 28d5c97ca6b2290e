"""The GGUF artefacts run in llama.cpp itself (``ctxc[llamacpp]``, issue 21): each against
llama.cpp's own full-context run on the unpatched GGUF, within twice llama.cpp's own distance
from Transformers; a failed check is one line, exit 2, no folder. The tests that run llama.cpp
skip, with the reason, where its library cannot load.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

import ctxc
from ctxc.backends.gguf.llama_cpp import check as gguf_llama_cpp
from ctxc.backends.gguf.llama_cpp import run as llama_cpp_run
from ctxc.backends.gguf.llama_cpp.run import LlamaCppFigures, llama_cpp_unavailable
from ctxc.backends.gguf.lora import emit_gguf_lora
from ctxc.backends.gguf.model import emit_gguf
from testbed.tiny_models import shared
from tests.backends.test_backend_gguf import _model_dir, bpe_tokenizer
from tests.fixtures.helpers import random_ids, run_cli

pytestmark = pytest.mark.tiny

_REASON = llama_cpp_unavailable()
needs_llama_cpp = pytest.mark.skipif(_REASON is not None, reason=f"llama.cpp: {_REASON}")


def _fig(f: LlamaCppFigures) -> str:
    return (
        f"in llama.cpp: patched max {f.patched.max_abs_logit_diff:.3g} mean "
        f"{f.patched.mean_abs_logit_diff:.3g}, bound {f.tolerance}, floor {f.floor:.3g}, "
        f"full vs Transformers {f.full_vs_transformers:.3g}, own {f.own:.3g}, control max "
        f"{f.control.max_abs_logit_diff:.3g}"
    )


def _assert_checked(f: LlamaCppFigures | None) -> None:
    assert f is not None
    assert f.reference.startswith("llama.cpp b") and f.reference.endswith(
        "unpatched GGUF, context+query"
    ), f.reference
    assert f.tolerance is not None and f.patched.max_abs_logit_diff <= f.tolerance, _fig(f)
    assert f.patched.top1_match, _fig(f)
    # The control must be far, or the check could not fail.
    assert f.control.max_abs_logit_diff > 100 * f.patched.max_abs_logit_diff, _fig(f)


@needs_llama_cpp
def test_gguf_model_runs_in_llama_cpp(tmp_path) -> None:
    model = shared("llama")
    patch = ctxc.compile(model, context_ids=random_ids(7, 24)).patch
    _, figures = emit_gguf(model, patch, tmp_path, tokenizer=bpe_tokenizer())
    _assert_checked(figures.llama_cpp)
    assert figures.llama_cpp_skipped is None
    assert "model.gguf" not in figures.llama_cpp.base  # the unpatched base, not the artefact


@needs_llama_cpp
def test_gguf_lora_runs_in_llama_cpp(tmp_path) -> None:
    model = shared("llama")
    patch = ctxc.compile(model, context_ids=random_ids(8, 24), update="lora").patch
    _, figures = emit_gguf_lora(model, patch, tmp_path, tokenizer=bpe_tokenizer())
    _assert_checked(figures.llama_cpp)
    assert figures.llama_cpp_source is None  # no source GGUF: the tiny model is not a file


@needs_llama_cpp
def test_cli_reports_the_llama_cpp_figures(tmp_path) -> None:
    folder, ctx = _model_dir(tmp_path, "llama")
    out = tmp_path / "out"
    args = ["--model", str(folder), "--context", str(ctx), "--update", "lora"]
    proc = run_cli("compile", *args, "--emit", "gguf,gguf-lora", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text())
    for kind in ("gguf", "gguf-lora"):
        f = report[kind]["llama_cpp"]
        assert f["reference"].endswith("unpatched GGUF, context+query"), f
        assert f["patched"]["max_abs_logit_diff"] <= f["tolerance"], f
    assert "in llama.cpp b" in proc.stdout, proc.stdout


@needs_llama_cpp
@pytest.mark.parametrize(("emit", "artefact"), [("gguf", "model.gguf"), ("gguf-lora", "lora.gguf")])
def test_failed_llama_cpp_check_is_one_line_and_no_folder(tmp_path, monkeypatch, emit, artefact):
    # A negative factor: no artefact can meet the bound, whatever its figure.
    monkeypatch.setattr(llama_cpp_run, "LLAMA_CPP_FACTOR", -1.0)
    folder, ctx = _model_dir(tmp_path, "llama")
    out = tmp_path / "out"
    args = ["--model", str(folder), "--context", str(ctx), "--update", "lora"]
    proc = run_cli("compile", *args, "--emit", emit, "--out", str(out))
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("ctxc: error:"), lines
    assert f"{artefact} check failed: in llama.cpp" in lines[0], lines
    assert "max |diff|" in lines[0], lines
    assert not out.exists()
    kept = tmp_path / "out.failed"  # the patch is kept for `ctxc export` (ctxc.core.checks)
    assert (kept / "patch.safetensors").is_file() and not (kept / artefact).exists()


def test_without_llama_cpp_the_figures_say_why(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gguf_llama_cpp, "llama_cpp_unavailable", lambda: "not installed here")
    model = shared("llama")
    patch = ctxc.compile(model, context_ids=random_ids(9, 20), update="lora").patch
    _, figures = emit_gguf_lora(model, patch, tmp_path, tokenizer=bpe_tokenizer())
    assert figures.llama_cpp is None and figures.llama_cpp_skipped == "not installed here"
    assert "not run in llama.cpp: not installed here" in figures.summary()
    assert figures.to_dict()["llama_cpp_skipped"] == "not installed here"


def test_without_a_tokenizer_the_check_says_why(tmp_path) -> None:
    model = shared("gemma3")  # no tokenizer, no source GGUF: no base GGUF can be written
    patch = ctxc.compile(model, context_ids=random_ids(10, 20), update="lora").patch
    _, figures = emit_gguf_lora(model, patch, tmp_path)
    assert figures.llama_cpp is None, figures
    assert figures.llama_cpp_skipped is not None, figures
    if _REASON is None:
        assert "no tokenizer" in figures.llama_cpp_skipped, figures.llama_cpp_skipped


@needs_llama_cpp
def test_an_adapter_that_changes_nothing_fails_beside_a_patch_far_from_the_full_context(
    tmp_path,
) -> None:
    """A baked patch is tens of logits from the full-context run, and so is an adapter that
    changes nothing: the bound against the full context alone (plus the patch's own distance)
    passes both. Held to ctxc's patched model too, the empty adapter fails (issue 36)."""
    import dataclasses

    from ctxc.backends.gguf.lora import write_gguf_lora
    from ctxc.backends.reference import check_ids, reference_logits, torch_logits
    from ctxc.core.errors import CtxcError

    model, tokenizer = shared("llama"), bpe_tokenizer()
    patch = ctxc.compile(model, context_ids=random_ids(8, 24), update="lora").patch
    empty = dataclasses.replace(
        patch,
        deltas={
            k: dataclasses.replace(d, u=torch.zeros_like(d.u)) for k, d in patch.deltas.items()
        },
    )
    path = tmp_path / "lora.gguf"
    write_gguf_lora(model, empty, path)
    full = reference_logits(model, patch)
    query = check_ids(patch)[:1]
    (alone,) = torch_logits(model, query)
    with patch.applied(model, check=False):
        (patched,) = torch_logits(model, query)
    own = 10 * float((alone - full).abs().max())  # as far as a bake may be
    run = functools.partial(
        gguf_llama_cpp.run_in_llama_cpp,
        model,
        patch,
        what="lora.gguf",
        full=full,
        tokenizer=tokenizer,
        lora=path,
        own=own,
    )
    vacuous = run().same_type  # the full-context bound alone: passed
    assert vacuous is not None and vacuous.vs_patched is None, vacuous
    with pytest.raises(CtxcError, match="vs ctxc's patched model in Transformers") as caught:
        run(transformers_patched=patched)
    assert "of the patch's effect" in str(caught.value), caught.value
    # The real adapter meets it.
    write_gguf_lora(model, patch, path)
    held = run(transformers_patched=patched).same_type
    assert held is not None and held.vs_patched is not None and held.patch_effect is not None
    assert held.vs_patched.max_abs_logit_diff <= held.patched_tolerance, _fig(held)
    assert held.vs_patched.max_abs_logit_diff < 0.01 * held.patch_effect, _fig(held)
    # A baked (fitted) patch's full-context bound takes the share of its effect too (the
    # triangle through ctxc's patched model); an exact compile's does not.
    from ctxc.backends.gguf.thresholds import (
        LLAMA_CPP_FACTOR,
        LLAMA_CPP_MIN_FLOOR,
        LLAMA_CPP_PATCH_SHARE,
    )

    scale = max(held.floor, held.full_vs_transformers, LLAMA_CPP_MIN_FLOOR)
    assert held.tolerance == pytest.approx(LLAMA_CPP_FACTOR * scale + own), _fig(held)
    baked = dataclasses.replace(patch, meta=dataclasses.replace(patch.meta, update="bake-fit"))
    fitted = run.func(model, baked, **{**run.keywords, "transformers_patched": patched}).same_type
    assert fitted is not None and fitted.tolerance is not None, fitted
    share = LLAMA_CPP_PATCH_SHARE * held.patch_effect
    assert fitted.tolerance == pytest.approx(held.tolerance + share, rel=1e-6), _fig(fitted)
