"""The real Gemma 3 270M (bundled GGUF, float32): the README's quick start prints what the
README and docs/cli.md say (issue 34), and each emitted model, reloaded by plain Transformers in
a fresh process without ctxc, reproduces the model fed context + query.

Two models: the README's quick start (``ctxc compile`` of ``examples/medium.txt``, the default
rule, its last token as the query: the ``quick_start`` fixture, whose printed figures
the test below checks), and ``examples/short.txt`` with a 9-token query compiled
here (issue 15, item 8: every block of this model ends in a scaled post norm, so the query's 9
positions share one scale per block, passes/solver/multi_scale.py), checked at every query
position. One fresh process loads the original model once and each ``model/`` folder, as a user
would (``AutoModelForCausalLM.from_pretrained``). The ``standard`` rule and the other texts on
this model: ``python -m benchmarks.fidelity.fresh --update standard --texts short medium long``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SHORT = ROOT / "examples" / "short.txt"
QUERY = " The name of the keeper's cat was"
# The cases: the README's quick start, and a 9-token query (the stable rule).
CASES = ("quick_start", "query9")

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
def checked(real_gemma, quick_start, tmp_path_factory) -> dict[str, dict]:
    """The 9-token query compiled and its model/ written here, then both cases checked in one
    fresh process."""
    import ctxc
    from ctxc.backends.torch.model import emit_torch
    from ctxc.models.load import bundled_model_dir
    from ctxc.store import frozen_shards

    model, tokenizer = real_gemma
    run, readme_out = quick_start
    assert run.returncode == 0, run.stderr
    out = tmp_path_factory.mktemp("query9")
    result = ctxc.compile(model, tokenizer, context=SHORT.read_text(), query=QUERY)
    # As the command line writes it: the unpatched weights linked from the cache (the entry
    # the quick start wrote: the same weights at the same addresses modulo 64).
    frozen_shards.enable(model)
    try:
        emit_torch(model, tokenizer, result.patch, out / "model")
    finally:
        frozen_shards.enable(model, False)
    assert len(list((out / "model").glob("model-0000?-of-00002.safetensors"))) == 2
    (out / "report.json").write_text(json.dumps(result.report.to_dict()))
    outs = {"quick_start": readme_out, "query9": out}
    cmd = [sys.executable, "-c", _CHECK, str(bundled_model_dir()), *map(str, outs.values())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {case: got[str(out)] for case, out in outs.items()}


@pytest.mark.parametrize("case", CASES)
def test_emitted_model_matches_full_context(checked, case: str) -> None:
    got = checked[case]
    per = got["per_position"]
    msg = (
        f"{case}: max |logit diff| per position {[f'{x:.2g}' for x in per]}, mean "
        f"{got['mean']:.3g} (unpatched control {got['control']:.3g}), top-1 {got['top1']}"
    )
    assert len(per) == (9 if case == "query9" else 1), msg
    # Measured 2.0e-5 at worst on the 9-token query (benchmarks/fidelity/multi_token.py); the
    # issue's bound is 5e-5.
    assert max(per) <= 5e-5, msg
    assert all(got["top1"]), msg
    assert got["control"] > 1.0, msg


def _indented_block(text: str, after: str) -> list[str]:
    """The indented (code) lines that follow the first line holding ``after``, unindented."""
    lines = text[text.index(after) :].splitlines()[1:]
    while lines and not lines[0].strip():
        lines.pop(0)
    block = []
    for line in lines:
        if not line.startswith("    "):
            break
        block.append(line[4:])
    return block


def _short(value: str) -> str:
    """A printed figure as the README's table writes it: ``1.43e-05`` -> ``1.43e-5``."""
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", value)


# A figure at the float32 rounding floor (max |logit diff|, total variation, the floor itself,
# the solver's) moves in its last bits with the CPU's kernels: the same code printed 1.34e-05,
# 1.24e-05 and 1.43e-05 on three hosts. Such a figure is compared within this factor; every
# other word and number (token counts, blocks, unpatched figures, top-1) exactly.
_HOST_FACTOR = 2.0
_FIGURE = re.compile(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?")


def _same_figures(documented: list[str], printed: list[str]) -> str | None:
    """None when ``documented`` lines say what ``printed`` ones do, figures at the rounding floor
    (under 1e-3) within :data:`_HOST_FACTOR`; else the first difference, in words."""
    if len(documented) != len(printed):
        return f"{len(documented)} lines against {len(printed)}"
    for doc, run in zip(documented, printed, strict=True):
        if _FIGURE.sub("#", doc) != _FIGURE.sub("#", run):
            return f"{doc!r} against {run!r}"
        for a, b in zip(_FIGURE.findall(doc), _FIGURE.findall(run), strict=True):
            x, y = float(a), float(b)
            tiny = max(x, y) < 1e-3 and min(x, y) > 0
            if (tiny and not 1 / _HOST_FACTOR <= x / y <= _HOST_FACTOR) or (not tiny and a != b):
                return f"{a} against {b} in {run!r}"
    return None


def test_quick_start_figures_are_what_the_command_prints(quick_start) -> None:
    """The README's quick start (``ctxc compile --context examples/medium.txt --out out`` on
    the bundled model) prints what the README, its table and docs/cli.md's log example say, at
    the README's thread count (the ``quick_start`` fixture): every word and count exactly, the
    figures at the rounding floor within a factor of 2 (they move with the host's CPU kernels).
    When the compile changes, regenerate the figures from the command and this passes again; it
    reads the documents, so it holds no figure itself."""
    run, _ = quick_start
    text = README.read_text()
    assert run.returncode == 0, run.stderr
    printed = run.stdout.splitlines()[:4]
    regenerate = f"regenerate the documents' figures from what the command prints: {printed}"

    readme = _indented_block(text, "and printed its figures:")
    differ = _same_figures(readme, printed)
    assert differ is None, f"README's quick start says {differ}; {regenerate}"
    log = _indented_block((ROOT / "docs" / "cli.md").read_text(), "bundled model:")[1:5]
    differ = _same_figures(log, printed)
    assert differ is None, f"docs/cli.md's log example says {differ}; {regenerate}"

    numbers = re.compile(r"context (\d+) tokens, query (\d+)").search(printed[0])
    emitted, unpatched = re.search(
        r"max \|logit diff\| (\S+) \(unpatched: (\S+)\)", printed[1]
    ).groups()
    floor, solver = re.search(r"its floor (\S+); solver (\S+)\)", printed[3]).groups()
    row = re.search(r"^\| `model/` reloaded, `examples/medium\.txt` \((\d+) tokens\) \| ([^|]+) \|",
                    text, re.M)  # fmt: skip
    assert row is not None, "README's table lost its examples/medium.txt row"
    want = (
        f"{_short(emitted)} (runtime floor {_short(floor)}, solver {_short(solver)}, "
        f"unpatched {unpatched})"
    )
    tokens = int(numbers.group(1)) + int(numbers.group(2))
    assert int(row.group(1)) == tokens, (
        f"README's table row says {row.group(1)} tokens; the command prints {tokens}"
    )
    differ = _same_figures([row.group(2).strip()], [want])
    assert differ is None, f"README's table row says {differ}; the command prints {want!r}"


def test_same_figures_lets_the_floor_move_and_nothing_else() -> None:
    """The comparison above lets a figure at the rounding floor move within a factor of 2 and
    holds every other word and number."""
    doc = ["context 389 tokens, query 1", "max |logit diff| 1.24e-05 (unpatched: 25.1)"]
    assert _same_figures(doc, ["context 389 tokens, query 1",
                               "max |logit diff| 1.43e-05 (unpatched: 25.1)"]) is None  # fmt: skip
    for changed in (
        ["context 390 tokens, query 1", doc[1]],
        [doc[0], "max |logit diff| 3.1e-05 (unpatched: 25.1)"],
        [doc[0], "max |logit diff| 1.24e-05 (unpatched: 25.2)"],
        [doc[0], "max |logit diff| 1.24e-05 (unpatched 25.1)"],
        [doc[0]],
    ):
        assert _same_figures(doc, changed) is not None, changed
