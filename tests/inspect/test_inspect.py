"""``ctxc inspect``: stable JSON (golden files), readable text, and an HTML page with diagrams.

Regenerate the golden files after an intended change with ``CTXC_UPDATE_GOLDEN=1 pytest
tests/inspect/test_inspect.py`` and review the diff.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ctxc.cli.app import main
from ctxc.inspect.inspection import inspect_model
from ctxc.inspect.render_html import render_html
from ctxc.inspect.render_json import inspection_dict
from ctxc.inspect.render_text import render_text
from testbed.tiny_models import shared, tiny_tokenizer
from tests.fixtures.custom_decoder import ToyLM

GOLDEN = Path(__file__).parents[1] / "golden"
GOLDEN_MODELS = ["gpt2", "olmo2", "qwen2_moe"]


@pytest.mark.tiny
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_json_matches_the_golden_file(name: str) -> None:
    got = inspection_dict(inspect_model(shared(name)))
    path = GOLDEN / f"{name}.json"
    if os.environ.get("CTXC_UPDATE_GOLDEN"):
        path.write_text(json.dumps(got, indent=2) + "\n")
    want = json.loads(path.read_text())
    assert got == want, f"inspect JSON of {name} differs from {path} (CTXC_UPDATE_GOLDEN=1)"
    # Stable names only: module paths and op kinds, never fx node names such as "linear_4".
    text = json.dumps(got)
    assert '"linear_' not in text and '"add_' not in text and '"mul_' not in text


@pytest.mark.tiny
def test_text_names_shapes_roles_patches_and_rejections() -> None:
    text = render_text(inspect_model(ToyLM(post=["scaled", "plain"])))
    assert "trunk.0.ffn [shape A]" in text
    assert "post-sublayer norm" in text or "sandwich norms" in text
    assert "trunk.0.ffn.w_a.weight: input-controllable" in text
    assert "trunk.0.post_ffn.gain (output, vector)" in text
    assert "trunk.1.ffn: REJECTED: post norm trunk.1.post_ffn (RMS norm) has no trainable" in text


@pytest.mark.tiny
def test_html_draws_each_shape_once_with_patched_parameters(tmp_path) -> None:
    page = render_html(inspect_model(shared("qwen2_moe")))
    assert page.count("<svg") == 1  # both blocks share one shape
    assert "mixture of experts (4 experts, top 2) + shared expert with a sigmoid gate" in page
    assert page.count(">P</text>") >= 5  # router, expert banks, shared gate/up, shared gate
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no headless chromium to render the page")
    html = tmp_path / "inspect.html"
    html.write_text(page)
    png = tmp_path / "inspect.png"
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--screenshot={png}",
            "--window-size=1800,900",
            html.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.tiny
def test_cli_formats(tmp_path, capsys) -> None:
    model = shared("gpt2")
    folder = tmp_path / "gpt2"
    model.save_pretrained(str(folder))
    tiny_tokenizer().save_pretrained(str(folder))
    assert main(["inspect", "--model", str(folder), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    want = json.loads((GOLDEN / "gpt2.json").read_text())
    assert data["blocks"] == want["blocks"] and data["summary"] == want["summary"]
    assert main(["inspect", "--model", str(folder)]) == 0
    assert "transformer.h.1.mlp [shape A]" in capsys.readouterr().out
    assert main(["inspect", "--model", str(folder), "--format", "html"]) == 0
    assert capsys.readouterr().out.startswith("<!doctype html>")


@pytest.mark.slow
def test_bundled_gemma_3_270m(capsys) -> None:
    assert main(["inspect", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    s = data["summary"]
    assert (s["patchable"], s["rejected"]) == (18, 0), s
    assert s["shapes"] == {"sequential, sandwich norms, gated MLP": 18}, s
    assert all(b["output_control"] == "scale" for b in data["blocks"])
