"""``ctxc bake --method additive``, ``--add`` and ``--remove`` on a tiny model (issue 36): the
chunks added one by one give the patch of a bake of them together, removing one gives back
the patch before it; LoRA emits refused in one line before anything loads."""

from __future__ import annotations

import json

import pytest

from ctxc.bake.scope import Scope, terms
from ctxc.patch import Patch
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import run_cli

pytestmark = pytest.mark.tiny

_FIT = ["--method", "additive", "--rank", "8", "--samples", "2", "--sample-tokens", "4",
        "--data", "continuations", "--eval-samples", "0"]  # fmt: skip


def _max_rel(a: Patch, b: Patch) -> float:
    assert list(a.deltas) == list(b.deltas)
    worst = 0.0
    for name, d in b.deltas.items():
        want, got = d.dense(), a.deltas[name].dense()
        worst = max(worst, float((got - want).abs().max()) / float(want.abs().max()))
    return worst


def test_add_and_remove_chunks(tiny_model_dir, tmp_path) -> None:
    files = []
    for i, words in enumerate(("w1 w2 w3 w4 w5 w6 w7 w8", "w13 w14 w15 w16 w17", "w30 w31 w32")):
        files.append(tmp_path / f"c{i}.txt")
        files[-1].write_text(words)
    model = ["--model", str(tiny_model_dir)]
    together, alone = tmp_path / "together", tmp_path / "alone"
    ctx = [a for f in files for a in ("--context", str(f))]
    assert run_cli("bake", *model, *_FIT, *ctx, "--out", str(together)).returncode == 0
    proc = run_cli("bake", *model, *_FIT, "--context", str(files[0]), "--out", str(alone))
    assert proc.returncode == 0, proc.stderr
    one = Patch.load(alone)
    for f in files[1:]:
        proc = run_cli("bake", *model, "--add", str(alone), "--context", str(f))
        assert proc.returncode == 0, proc.stderr
    assert "chunks: " in proc.stdout and "c2.txt" in proc.stdout, proc.stdout
    rel = _max_rel(Patch.load(alone), Patch.load(together))
    assert rel == 0.0, f"one by one vs together: max relative difference {rel:.3g}"
    report = json.loads((alone / "report.json").read_text())
    assert [c["name"] for c in report["chunks"]] == ["c0.txt", "c1.txt", "c2.txt"]
    # The scope (issue 53): every chunk's words, added one by one as baked together.
    words = Scope.load(together).words
    assert Scope.load(alone).words == words == terms(" ".join(f.read_text() for f in files))
    assert "served with its scope" in proc.stdout, proc.stdout
    for f in files[:0:-1]:
        proc = run_cli("bake", *model, "--remove", str(alone), "--chunk", f.name)
        assert proc.returncode == 0, proc.stderr
    rel = _max_rel(Patch.load(alone), one)
    assert rel <= 1e-6, f"removing the chunks: max relative difference {rel:.3g} > 1e-6"
    assert Scope.load(alone).words == words  # a removed chunk's words stay (a superset)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--remove", "{dir}"], "--remove DIR takes --chunk ID"),
        (["--add", "{dir}"], "--add DIR takes the new chunk as --context"),
        (["--remove", "{dir}", "--chunk", "nope"], "has no stats.safetensors"),
        (["--context", "{ctx}", "--context", "{ctx}"], "need --method additive"),
        # --emit lora: without the [peft] extra, that is the line.
        # (a fit that moves norm scales is refused once the model's blocks are located:
        # tests/bake/test_bake_serve.py)
        pytest.param(  # a distilled bake is LoRA pairs: servable, at a rank vLLM takes
            ["--context", "{ctx}", "--emit", "lora", "--method", "distill", "--rank", "full"],
            "one rank for every module: give --rank N, not full",
            marks=needs_extra("peft"),
        ),
        pytest.param(
            ["--context", "{ctx}", "--emit", "lora", "--linear-only", "--rank", "12"],
            "not one",
            marks=needs_extra("peft"),
        ),
        (["--context", "{ctx}", "--method", "additive", "--rank", "auto"], "is for --method fit"),
        (["--add", "{dir}", "--context", "{ctx}", "--rank", "8"], "--rank cannot change them"),
        (["--remove", "{dir}", "--chunk", "a", "--linear-only"], "--linear-only cannot change"),
    ],
)
def test_bad_chunk_input_is_one_line(tmp_path, args, message) -> None:
    ctx = tmp_path / "c.txt"
    ctx.write_text("w1 w2 w3")
    (tmp_path / "d").mkdir()
    filled = [a.format(dir=tmp_path / "d", ctx=ctx) for a in args]
    proc = run_cli("bake", "--model", "nowhere", *filled, "--out", str(tmp_path / "o"))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "o").exists()
