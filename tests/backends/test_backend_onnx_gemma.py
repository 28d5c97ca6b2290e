"""The real Gemma 3 270M (bundled, float32) through onnxruntime: the adapter path within 1e-3.

One text of benchmarks/texts (02_recipe: 129 tokens, the worst of the ten before the stable
rule took the least-ratio scale change, at 7.6e-3 in onnxruntime) is compiled, exported as a
patchable ONNX with its ``.onnx_adapter`` (the emitter checks onnxruntime with the adapter against
the torch patched model within ONNX_ATOL, absolute), and onnxruntime fed the query alone is
compared with the full context. Takes about three minutes and 8 GB of memory (the export).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ctxc
from ctxc.backends.onnx.check import ONNX_ATOL, ort_session
from ctxc.backends.onnx.ort_adapter import (
    PATCHABLE_FILE,
    emit_ort_adapter,
    load_adapter,
    run_adapter,
)
from tests.fixtures.helpers import diff_msg, max_diff

pytestmark = [pytest.mark.tiny, pytest.mark.slow]

TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "texts" / "02_recipe.txt"


def test_adapter_on_gemma_is_within_onnx_atol_of_full_context(tmp_path) -> None:
    model, tok = ctxc.load_model("gemma-3-270m", "float32")
    result = ctxc.compile(model, tok, context=TEXT.read_text())
    full = result.full_logits
    path, figures = emit_ort_adapter(model, result.patch, tmp_path, full=full)
    assert all(c.max_abs_diff <= ONNX_ATOL for c in figures.checks), figures.checks
    session = ort_session(tmp_path / PATCHABLE_FILE)
    q = np.array([result.patch.meta.query_ids], np.int64)
    got = run_adapter(session, load_adapter(path, session), q)[0]
    control = result.report.control.max_abs_logit_diff
    msg = diff_msg(f"onnxruntime + adapter vs full context (control {control:.3g})", got, full)
    assert max_diff(got, full) <= ONNX_ATOL, msg
    assert int(np.argmax(got[-1])) == int(full[-1].argmax()), msg
    assert control > 1.0, msg
