"""A missing optional library (torchvision, timm, Pillow) is one line naming the package to
install, exit 2, no folder (issue 21). Each run blocks the library in a fresh process
(``sys.modules[name] = None``: ``import`` fails and ``importlib.util.find_spec`` finds nothing,
as when it is not installed), whether or not it is installed here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ctxc.core.errors import missing_package
from testbed.tiny_vlms import _tokenizer, build_qwen2_vl, build_vlm, make_image
from tests.fixtures.helpers import without_trail

pytestmark = pytest.mark.tiny

_BLOCKED_RUN = (
    "import sys\n"
    "for name in sys.argv[1].split(','):\n"
    "    sys.modules[name] = None\n"
    "from ctxc.cli.app import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def _ctxc_without(blocked: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _BLOCKED_RUN, blocked, *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def _assert_one_line(proc: subprocess.CompletedProcess, package: str, out: Path) -> None:
    # The progress trail (plain lines on a non-terminal stderr) comes first; then one error line.
    lines = [line for line in without_trail(proc.stderr).splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("ctxc: error:"), lines
    assert package in lines[0] and "pip install" in lines[0], lines
    assert not out.exists()


def test_missing_package_reads_import_errors() -> None:
    cases = {
        "torchvision": ModuleNotFoundError("no", name="torchvision.transforms"),
        "timm": ImportError("\nTimmWrapperModel requires the timm library but it was not found"),
        "Pillow": ImportError("\nSiglipImageProcessor requires the PIL library but it was not"),
    }
    for package, exc in cases.items():
        found = missing_package(exc)
        assert found is not None and found[0] == package, (package, found)
    wrapped = RuntimeError("while loading")
    wrapped.__cause__ = cases["timm"]
    assert missing_package(wrapped) == ("timm", "TimmWrapperModel")
    assert missing_package(ModuleNotFoundError("no", name="onnx")) is None
    assert missing_package(ValueError("requires the timm library")) is None


def test_processor_without_torchvision(tmp_path) -> None:
    # Was "ctxc: internal error: ImportError", exit 1: its video processor imports torchvision.
    folder = build_qwen2_vl(tmp_path / "qwen2-vl")
    (tmp_path / "ctx.txt").write_text("w5 w6 w7")
    image = make_image(tmp_path / "a.png", 1)
    out = tmp_path / "out"
    args = ["compile", "--model", str(folder), "--context", str(tmp_path / "ctx.txt")]
    proc = _ctxc_without("torchvision", *args, "--image", str(image), "--out", str(out))
    _assert_one_line(proc, "torchvision", out)
    assert "Qwen2VL" in proc.stderr, proc.stderr


def test_model_without_timm(tmp_path) -> None:
    # FastVLM's vision tower is a timm model: the model itself cannot be built without timm.
    import transformers as tf

    from testbed.tiny_vlms import _TEXT

    folder = tmp_path / "fast-vlm"
    tf.FastVlmConfig(text_config=dict(model_type="qwen2", **_TEXT)).save_pretrained(str(folder))
    _tokenizer({"image_token": "<image>"}).save_pretrained(str(folder))
    save_file({"x": torch.zeros(1)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "ctx.txt").write_text("w5 w6 w7")
    out = tmp_path / "out"
    args = ["compile", "--model", str(folder), "--context", str(tmp_path / "ctx.txt")]
    proc = _ctxc_without("timm", *args, "--out", str(out))
    _assert_one_line(proc, "timm", out)


def test_image_without_pillow(tmp_path) -> None:
    folder = build_vlm("gemma3", tmp_path / "gemma3")
    (tmp_path / "ctx.txt").write_text("w5 w6 w7")
    image = make_image(tmp_path / "a.png", 1)
    out = tmp_path / "out"
    args = ["compile", "--model", str(folder), "--context", str(tmp_path / "ctx.txt")]
    proc = _ctxc_without("PIL", *args, "--image", str(image), "--out", str(out))
    _assert_one_line(proc, "Pillow", out)
