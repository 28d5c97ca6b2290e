"""The CLI contract: outputs of a successful compile, and one-line errors for bad input."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.fixtures.helpers import run_cli

pytestmark = pytest.mark.tiny


def test_compile_writes_patch_report_and_a_plain_transformers_model(tiny_model_dir, tmp_path):
    context = tmp_path / "context.txt"
    context.write_text("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12")
    out = tmp_path / "out"
    proc = run_cli(
        "compile",
        "--model",
        str(tiny_model_dir),
        "--context",
        str(context),
        "--out",
        str(out),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == [".ctxc", "model", "patch.safetensors", "report.json"], names
    report = json.loads((out / "report.json").read_text())
    for key in (
        "context_ids",
        "query_ids",
        "max_abs_logit_diff",
        "total_variation",
        "top1_match",
        "control",
        "blocks",
        "timings",
    ):
        assert key in report, key
    # The tokenizer files are the loaded folder's, copied (backends/torch/model.py).
    published = sorted(p.name for p in tiny_model_dir.iterdir() if p.name.startswith("tokenizer"))
    assert published, sorted(p.name for p in tiny_model_dir.iterdir())
    for name in published:
        assert (out / "model" / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    # The emitted model, loaded by plain Transformers and fed the query alone.
    tok = AutoTokenizer.from_pretrained(str(out / "model"))
    model = AutoModelForCausalLM.from_pretrained(str(out / "model"), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    full_ids = torch.tensor([report["context_ids"] + report["query_ids"]])
    assert full_ids[0].tolist() == tok(context.read_text()).input_ids
    with torch.no_grad():
        full = base(full_ids).logits[0, -1]
        patched = model(torch.tensor([report["query_ids"]])).logits[0, -1]
        control = base(torch.tensor([report["query_ids"]])).logits[0, -1]
    diff = (patched - full).abs()
    assert float(diff.max()) <= 1e-5, f"max {float(diff.max()):.3g} mean {float(diff.mean()):.3g}"
    assert float((control - full).abs().max()) > 1e-2
    assert abs(report["max_abs_logit_diff"] - float(diff.max())) <= 1e-6


@pytest.fixture
def files(tmp_path):
    good = tmp_path / "good.txt"
    good.write_text("w1 w2 w3")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00abc\x80")
    nomodel = tmp_path / "not-a-model"
    nomodel.mkdir()
    return {"good": good, "empty": empty, "binary": binary, "nomodel": nomodel}


CASES = {
    "missing file": (["--context", "{tmp}/missing.txt"], "context file not found"),
    "empty file": (["--context", "{empty}"], "context file is empty"),
    "non-UTF-8 file": (["--context", "{binary}"], "not UTF-8"),
    "unknown model": (["--context", "{good}", "--model", "no-such-model"], "unknown model"),
    "folder that is no model": (["--context", "{good}", "--model", "{nomodel}"], "no config.json"),
    "unknown dtype": (["--context", "{good}", "--dtype", "float64"], "float64"),
    "uncached alias": (["--context", "{good}", "--model", "gemma-3-1b"], "hf download"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_gives_one_line_and_no_output(case, files, tmp_path):
    args, expected = CASES[case]
    subst = {"tmp": tmp_path, **files}
    args = [a.format(**subst) for a in args]
    out = tmp_path / "out"
    proc = run_cli("compile", *args, "--out", str(out), cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ctxc: error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial")]


def test_non_empty_output_folder_is_kept(tiny_model_dir, files, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run_cli(
        "compile",
        "--model",
        str(tiny_model_dir),
        "--context",
        str(files["good"]),
        "--out",
        str(out),
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[0] == (
        f"ctxc: error: output folder {out} holds files ctxc did not write ('keep.txt'): "
        "name another folder (--force replaces only an earlier ctxc output)"
    )
    assert (out / "keep.txt").read_text() == "mine"


def test_inspect_json_names_every_block(tiny_model_dir, tmp_path):
    proc = run_cli("inspect", "--model", str(tiny_model_dir), "--format", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    s = info["summary"]
    assert (s["blocks"], s["patchable"], s["rejected"]) == (3, 3, 0), s
    assert s["patched_params"] == {"standard": 9, "stable": 12, "output": 6, "lora": 12}, s
    assert [b["path"] for b in info["blocks"]] == [f"model.layers.{i}.mlp" for i in range(3)]
