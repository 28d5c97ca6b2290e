"""The real Gemma 3 270M (bundled GGUF, float32) with a multi-token query (issue 15, item 8).

Every block of this model ends in a scaled post norm, so the query's 9 positions share one scale
per block (passes/multi_scale.py). The emitted model, reloaded by plain Transformers in a process
without ctxc, must match the model fed context + query at every query position.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHORT = ROOT / "examples" / "short.txt"
QUERY = " The name of the keeper's cat was"

_CHECK = """
import json, sys, torch
from transformers import AutoModelForCausalLM
out, base = sys.argv[1], sys.argv[2]
rep = json.load(open(out + "/report.json"))
patched = AutoModelForCausalLM.from_pretrained(out + "/model", dtype=torch.float32).eval()
orig = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
q = torch.tensor([rep["query_ids"]])
k = q.shape[1]
with torch.no_grad():
    full = orig(torch.tensor([rep["context_ids"] + rep["query_ids"]])).logits[0, -k:]
    got = patched(q).logits[0]
    ctl = orig(q).logits[0]
print(json.dumps({"per_position": (got - full).abs().amax(-1).tolist(),
                  "top1": (got.argmax(-1) == full.argmax(-1)).tolist(),
                  "control": float((ctl - full).abs().max()),
                  "gain": max(b["max_gain"] for b in rep["blocks"])}))
"""


def test_nine_token_query_is_exact_at_every_position(tmp_path):
    from ctxc.models import DEFAULT_MODEL, _bundled_gguf, _converted

    base = _converted(_bundled_gguf())
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ctxc.cli", "compile", "--model", DEFAULT_MODEL]
    cmd += ["--context", str(SHORT), "--query", QUERY, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    check = subprocess.run(
        [sys.executable, "-c", _CHECK, str(out), str(base)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert check.returncode == 0, check.stderr[-2000:]
    got = json.loads(check.stdout.strip().splitlines()[-1])
    per = got["per_position"]
    msg = (
        f"max |logit diff| per position {[f'{x:.2g}' for x in per]} "
        f"(unpatched control {got['control']:.3g}), top-1 {got['top1']}, "
        f"largest gain {got['gain']:.3g}"
    )
    assert len(per) == 9, msg
    # Measured 2.0e-5 at worst (benchmarks/multi_token.py); the bound is 5e-5.
    assert max(per) <= 5e-5, msg
    assert all(got["top1"]), msg
    assert got["control"] > 1.0, msg
