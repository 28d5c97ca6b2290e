"""``ctxc compile/generate --image`` and ``ctxc inspect`` on tiny vision-language models
(issue 12): the written folder as plain Transformers loads it, one-line errors, no folder left.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from testbed.tiny_vlms import build_vlm, make_image
from tests.fixtures.helpers import diff_msg, max_diff, run_cli

TEXT = "w5 w6 w7 w8 w9 w10"
QUERY = "w20 w21"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli-vlm")
    gemma3 = build_vlm("gemma3", root / "gemma3")
    bare = root / "no-processor"  # the model and its tokenizer, no image processor
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gemma3 / name, bare / name)
    (root / "ctx.txt").write_text(TEXT)
    (root / "not-an-image.png").write_text("these are words, not pixels")
    return {
        "root": root,
        "gemma3": gemma3,
        "bare": bare,
        "image": make_image(root / "a.png", 1),
        "jpeg": make_image(root / "b.jpg", 2),
    }


def _reference(folder: Path, image: Path, query_ids: list[int]) -> torch.Tensor:
    """The original model with the image and the text, then the query: [k, vocab]."""
    from PIL import Image

    model = AutoModelForImageTextToText.from_pretrained(str(folder)).eval()
    processor = AutoProcessor.from_pretrained(str(folder))
    with Image.open(image) as img:
        enc = processor(
            text=f"{processor.image_token}\n{TEXT}",
            images=[img.convert("RGB")],
            return_tensors="pt",
        )
    q = torch.tensor([query_ids])
    inputs = {
        "input_ids": torch.cat([enc["input_ids"], q], 1),
        "pixel_values": enc["pixel_values"],
        "token_type_ids": torch.cat([enc["token_type_ids"], torch.zeros_like(q)], 1),
    }
    with torch.no_grad():
        return model(**inputs).logits[0, -len(query_ids) :].float()


@pytest.mark.tiny
def test_compile_with_an_image_writes_the_whole_model(files, tmp_path) -> None:
    args = ["compile", "--model", str(files["gemma3"]), "--context", str(files["root"] / "ctx.txt")]
    run = run_cli(
        *args, "--image", str(files["image"]), "--query", QUERY, "--out", "out", cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    out = tmp_path / "out"
    report = json.loads((out / "report.json").read_text())
    assert report["images"]["image_tokens"] == 4
    assert report["images"]["images"][0].startswith("a.png ")
    assert "AutoModelForImageTextToText" in report["emitted_measured_on"]
    # DIR/model is the whole model with its processor, as plain Transformers loads it.
    model = AutoModelForImageTextToText.from_pretrained(str(out / "model")).eval()
    assert sum(p.numel() for n, p in model.named_parameters() if "vision_tower" in n) > 0
    assert AutoProcessor.from_pretrained(str(out / "model")).image_processor is not None
    with torch.no_grad():
        got = model(input_ids=torch.tensor([report["query_ids"]])).logits[0].float()
    want = _reference(files["gemma3"], files["image"], report["query_ids"])
    assert max_diff(got, want) <= 1e-5, diff_msg("model/ fed the query alone", got, want)
    assert report["control"]["max_abs_logit_diff"] > 1e-2, report["control"]
    # export has no pixels to check an image patch against: refused, nothing written.
    refused = run_cli(
        "export", "--patch", "out", "--model", str(files["gemma3"]), "--out", "exp", cwd=tmp_path
    )
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.startswith("ctxc: error: this patch was compiled from an image context")
    assert not (tmp_path / "exp").exists()
    # The vision tower is the original's, bit for bit.
    original = AutoModelForImageTextToText.from_pretrained(str(files["gemma3"]))
    tower = {n: p for n, p in original.named_parameters() if "vision" in n or "projector" in n}
    for name, param in model.named_parameters():
        if name in tower:
            assert torch.equal(param, tower[name]), name


@pytest.mark.tiny
@pytest.mark.parametrize("family", ["gemma3", "paligemma"])
def test_a_failed_check_with_an_image_exits_2_and_writes_no_folder(family, tmp_path, monkeypatch):
    """An image context's model/ failing its check is exit 2, one line, no out/; the patch is
    kept in out.failed/ (the same gate as a text context, through the same emit loop)."""
    folder = build_vlm(family, tmp_path / family)
    image = make_image(tmp_path / "a.png", 1)
    monkeypatch.setenv("CTXC_TEST_FAIL_CHECK", "torch")
    args = ["compile", "--model", str(folder), "--image", str(image), "--query", QUERY]
    run = run_cli(*args, "--out", "out", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.strip().splitlines() if line.startswith("ctxc: error")]
    assert len(lines) == 1 and lines[0].startswith("ctxc: error: model/ check failed: "), lines
    assert not (tmp_path / "out").exists()
    kept = sorted(p.name for p in (tmp_path / "out.failed").iterdir())
    assert kept == [".ctxc", "patch.safetensors", "report.json"], kept


@pytest.mark.slow  # exports ONNX
def test_compile_an_image_only_context_to_onnx(files, tmp_path) -> None:
    args = ["compile", "--model", str(files["gemma3"]), "--image", str(files["jpeg"])]
    run = run_cli(*args, "--emit", "onnx", "--out", "out", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["onnx"]["fidelity"]["max_abs_logit_diff"] <= 1e-4, report["onnx"]
    assert report["control"]["max_abs_logit_diff"] > 1e-2, report["control"]
    assert (tmp_path / "out" / "model.onnx").is_file()


@pytest.mark.tiny
def test_generate_with_an_image_matches_every_step(files, tmp_path) -> None:
    args = [
        "generate",
        "--model",
        str(files["gemma3"]),
        "--context",
        str(files["root"] / "ctx.txt"),
    ]
    run = run_cli(
        *args, "--image", str(files["image"]), "--max-new-tokens", "4", "--out", "g", cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    data = json.loads((tmp_path / "g" / "generate.json").read_text())
    assert data["summary"]["steps"] == 4
    assert all(s["match"] for s in data["steps"]), data["steps"]
    assert data["summary"]["max_abs_logit_diff"] <= 1e-5, data["summary"]


@pytest.mark.tiny
def test_inspect_lists_the_language_blocks_and_says_the_tower_is_not_patched(files) -> None:
    run = run_cli("inspect", "--model", str(files["gemma3"]))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    blocks = [ln for ln in lines if ln.startswith("model.language_model.layers.")]
    assert len(blocks) == 3, run.stdout
    tower = [ln for ln in lines if ln.startswith("model.vision_tower: note:")]
    assert len(tower) == 1 and "never patched" in tower[0], run.stdout


@pytest.mark.tiny
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "ctxc: error: image file not found: nope.png"),
        ("not_an_image", "ctxc: error: not an image file (PNG, JPEG, ...): {not_an_image}"),
        ("text_only", "ctxc: error: model '{text_only}' is a text-only model"),
        ("no_processor", "ctxc: error: model '{bare}' has no processor in {bare}"),
        ("with_contexts", "ctxc: error: --image applies to --context"),
    ],
)
def test_bad_image_input_is_one_line_and_no_folder(
    files, tiny_model_dir, tmp_path, case, message
) -> None:
    names = {
        "not_an_image": files["root"] / "not-an-image.png",
        "text_only": tiny_model_dir,
        "bare": files["bare"],
    }
    model, image, extra = (
        files["gemma3"],
        files["image"],
        ["--context", str(files["root"] / "ctx.txt")],
    )
    if case == "missing":
        image = Path("nope.png")
    elif case == "not_an_image":
        image = names["not_an_image"]
    elif case == "text_only":
        model = tiny_model_dir
    elif case == "no_processor":
        model = files["bare"]
    else:
        (tmp_path / "c.jsonl").write_text('{"context": "w5 w6"}\n')
        extra = ["--contexts", "c.jsonl"]
    args = ["compile", "--model", str(model), *extra, "--image", str(image), "--out", "out"]
    run = run_cli(*args, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message.format(**names)), run.stderr
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != "c.jsonl"] == []
