"""The real Gemma 3 270M (bundled GGUF, float32): each emitted model, reloaded by plain
Transformers in a fresh process without ctxc, reproduces the model fed context + query.

Three compiles of ``examples/short.txt`` on one loaded model: the ``standard`` and ``stable``
rules with the context's last token as the query, and a 9-token query (issue 15, item 8: every
block of this model ends in a scaled post norm, so the query's 9 positions share one scale per
block, passes/solver/multi_scale.py), checked at every query position. One fresh process loads
the original model once and each ``model/`` folder, as a user would
(``AutoModelForCausalLM.from_pretrained``). The CLI's own run of the bundled model is checked by
tests/project/test_readme.py.
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
# case -> (update rule, query text or None for the context's last token)
CASES = {"standard": ("standard", None), "stable": ("stable", None), "query9": ("stable", QUERY)}

_CHECK = """
import json, sys, torch
from transformers import AutoModelForCausalLM
base, outs = sys.argv[1], sys.argv[2:]
orig = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
got = {}
for out in outs:
    rep = json.load(open(out + "/report.json"))
    patched = AutoModelForCausalLM.from_pretrained(out + "/model", dtype=torch.float32).eval()
    q = torch.tensor([rep["query_ids"]])
    k = q.shape[1]
    with torch.no_grad():
        full = orig(torch.tensor([rep["context_ids"] + rep["query_ids"]])).logits[0, -k:]
        mine = patched(q).logits[0]
        ctl = orig(q).logits[0]
    del patched
    got[out] = {"per_position": (mine - full).abs().amax(-1).tolist(),
                "mean": float((mine - full).abs().mean()),
                "top1": (mine.argmax(-1) == full.argmax(-1)).tolist(),
                "control": float((ctl - full).abs().max())}
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def checked(real_gemma, tmp_path_factory) -> dict[str, dict]:
    """Each case compiled and its model/ written here, then all checked in one fresh process."""
    import ctxc
    from ctxc.backends.torch.model import emit_torch
    from ctxc.models.load import bundled_model_dir

    model, tokenizer = real_gemma
    context = SHORT.read_text()
    outs = {}
    for case, (update, query) in CASES.items():
        out = tmp_path_factory.mktemp(case)
        result = ctxc.compile(model, tokenizer, context=context, query=query, update=update)
        emit_torch(model, tokenizer, result.patch, out / "model")
        (out / "report.json").write_text(json.dumps(result.report.to_dict()))
        outs[case] = out
    cmd = [sys.executable, "-c", _CHECK, str(bundled_model_dir()), *map(str, outs.values())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {case: got[str(out)] for case, out in outs.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_emitted_model_matches_full_context(checked, case: str) -> None:
    got = checked[case]
    per = got["per_position"]
    msg = (
        f"{case}: max |logit diff| per position {[f'{x:.2g}' for x in per]}, mean "
        f"{got['mean']:.3g} (unpatched control {got['control']:.3g}), top-1 {got['top1']}"
    )
    assert len(per) == (9 if CASES[case][1] else 1), msg
    # Measured 2.0e-5 at worst on the 9-token query (benchmarks/fidelity/multi_token.py); the
    # issue's bound is 5e-5.
    assert max(per) <= 5e-5, msg
    assert all(got["top1"]), msg
    assert got["control"] > 1.0, msg
