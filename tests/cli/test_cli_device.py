"""``--device``, ``--device-map`` and ``--max-memory`` on every model command (issue 10)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import run_cli

pytestmark = pytest.mark.tiny

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def context(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ctx") / "context.txt"
    path.write_text("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12")
    return path


def _commands(model: Path, context: Path, out: Path) -> dict[str, list[str]]:
    m = ["--model", str(model)]
    return {
        "compile": ["compile", *m, "--context", str(context), "--out", str(out)],
        "generate": ["generate", *m, "--context", str(context), "--out", str(out)],
        "export": ["export", "--patch", str(context), *m, "--out", str(out)],
        "inspect": ["inspect", *m],
    }


BAD = [
    (["--device", "cuda:99"], "device 'cuda:99' is not available"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--device-map", "auto", "--max-memory", "cpu=lots"], "bad size 'lots' in 'cpu=lots'"),
    (["--device-map", "auto", "--max-memory", "cpu=1GiB,gpu"], "malformed part 'gpu'"),
    (["--device-map", "auto", "--max-memory", "npu=1GiB"], "unknown device 'npu'"),
    (["--device-map", "auto", "--max-memory", "99=1GiB"], "'99=1GiB': device 'cuda:99'"),
    (["--device-map", "everywhere"], "unknown strategy 'everywhere'"),
    (["--max-memory", "cpu=1GiB"], "--max-memory applies to --device-map"),
    (["--device", "cpu", "--device-map", "auto"], "exclusive"),
]


@pytest.mark.parametrize("command", ["compile", "generate", "export", "inspect"])
@pytest.mark.parametrize(("flags", "message"), BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_placement_is_one_line_exit_2_and_no_folder(
    command, flags, message, tiny_model_dir, context, tmp_path
):
    out = tmp_path / "out"
    proc = run_cli(*_commands(tiny_model_dir, context, out)[command], *flags, cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ctxc: error: "), proc.stderr
    assert message in lines[0], lines[0]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []


def test_device_map_compile_writes_the_in_memory_patch(tiny_model_dir, context, tmp_path):
    runs = {
        "cpu": ["--device", "cpu"],
        "offloaded": ["--device-map", "sequential", "--max-memory", "cpu=200KB"],
    }
    for name, flags in runs.items():
        args = ["compile", "--model", str(tiny_model_dir), "--context", str(context)]
        proc = run_cli(*args, "--out", str(tmp_path / name), *flags, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    patches = [(tmp_path / n / "patch.safetensors").read_bytes() for n in runs]
    assert patches[0] == patches[1]
    reports = {n: json.loads((tmp_path / n / "report.json").read_text()) for n in runs}
    assert reports["cpu"]["device"] == reports["offloaded"]["device"] == "cpu"
    assert set(reports["cpu"]["placement"]) == {"cpu"}
    placed = reports["offloaded"]["placement"]
    assert placed["disk"] > placed.get("cpu", 0), placed
    for name, report in reports.items():
        assert report["max_abs_logit_diff"] <= 1e-5, (name, report["max_abs_logit_diff"])
        assert report["control"]["max_abs_logit_diff"] > 1e-2, (name, report["control"])


@needs_extra("onnx")
def test_device_map_refuses_onnx_before_loading(tiny_model_dir, context, tmp_path):
    args = ["compile", "--model", str(tiny_model_dir), "--context", str(context)]
    proc = run_cli(*args, "--out", "o", "--device-map", "auto", "--emit", "torch,onnx")
    assert proc.returncode == 2 and "not onnx" in proc.stderr, proc.stderr


def test_gpu_check_runs_on_cpu(tiny_model_dir, context):
    """The GPU check (a ready script for a machine with a GPU) runs through on the CPU, as
    ``python -m benchmarks.fidelity.gpu_check`` (tests import nothing from benchmarks/)."""
    argv = ["--device", "cpu", "--model", str(tiny_model_dir), "--context", str(context)]
    argv += ["--steps", "2", "--prompts", "1", "--no-onnx", "--dtypes", "float32"]
    cmd = [sys.executable, "-m", "benchmarks.fidelity.gpu_check", *argv]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    printed = proc.stdout
    assert proc.returncode == 0, printed + proc.stderr[-2000:]
    assert "compile: max |logit diff|" in printed and "report device cpu" in printed, printed
    assert "table stable  : match 2/2" in printed, printed
