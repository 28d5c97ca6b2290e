"""`ctxc generate` on the plain install, and `--skip-unpatchable` with nothing left to patch
(issue 15, items 4, 8 (the zero-patched part) and 9)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import ctxc
from ctxc.cli.app import main
from testbed.tiny_models import VOCAB, build_any, tiny_tokenizer
from tests.fixtures.helpers import without_trail

pytestmark = pytest.mark.tiny

IDS = torch.randint(4, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()


def test_generate_without_matplotlib_writes_json_and_says_which_extra(
    tiny_model_dir, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text("w5 w6 w7 w8 w9 w10 w11")
    args = ["generate", "--model", str(tiny_model_dir), "--context", "c.txt"]
    assert main([*args, "--max-new-tokens", "2", "--out", "gen"]) == 0
    captured = capsys.readouterr()
    assert without_trail(captured.err).splitlines() == [
        "ctxc: generate.png skipped: matplotlib is not installed (pip install 'ctxc[plot]')"
    ]
    assert sorted(p.name for p in (tmp_path / "gen").iterdir()) == [".ctxc", "generate.json"]
    data = json.loads((tmp_path / "gen" / "generate.json").read_text())
    summary, steps = data["summary"], data["steps"]
    # The mean is over all compared logits; the mean of the per-step maxima is named so.
    assert summary["mean_abs_logit_diff"] == pytest.approx(
        sum(s["mean_abs_logit_diff"] for s in steps) / len(steps), rel=1e-12
    )
    assert summary["mean_step_max_abs_logit_diff"] == pytest.approx(
        sum(s["max_abs_logit_diff"] for s in steps) / len(steps), rel=1e-12
    )


def test_generate_past_the_positions_is_refused(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text(" ".join(f"w{i % 100}" for i in range(250)))
    args = ["generate", "--model", str(tiny_model_dir), "--context", "c.txt"]
    assert main([*args, "--max-new-tokens", "10", "--out", "gen"]) == 2
    assert without_trail(capsys.readouterr().err).splitlines() == [
        "ctxc: error: context + 10 new tokens is 261 tokens; the model takes at most 256 "
        "positions (max_position_embeddings)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


def _dead_rows():
    model = build_any("olmo2")
    with torch.no_grad():  # every block's normalised output is exactly 0 at row 7: standard fails
        for layer in model.model.layers:
            layer.mlp.down_proj.weight[7].zero_()
    return model


def test_skip_unpatchable_with_nothing_patched_is_an_error(tmp_path, monkeypatch, capsys):
    model = _dead_rows()
    with pytest.raises(
        ctxc.UnpatchableError,
        match=r"^no block was patched: model\.layers\.0\.mlp: .*; model\.layers\.1\.mlp: ",
    ):
        ctxc.compile(model, context_ids=IDS, update="standard", skip_unpatchable=True)
    folder = tmp_path / "olmo2"
    model.save_pretrained(str(folder))
    tiny_tokenizer().save_pretrained(str(folder))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text(" ".join(f"w{i}" for i in IDS[:20]))
    args = ["compile", "--model", str(folder), "--context", "c.txt", "--update", "standard"]
    assert main([*args, "--skip-unpatchable", "--out", "out"]) == 2
    first = without_trail(capsys.readouterr().err).splitlines()[0]
    assert first.startswith(
        "ctxc: error: no block was patched: model.layers.0.mlp: normalised MLP output is exactly 0"
    ), first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "olmo2"]
