"""Usage errors of the CLI: one line `ctxc: error: ...` naming the option, exit 2 (issue 15.3).

In process (`ctxc.cli.app.main`): each case asserts the exact first line of stderr, the exit code,
and that nothing was written in the current folder.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ctxc import __version__
from ctxc.cli.app import main
from tests.fixtures import extras

pytestmark = pytest.mark.tiny

CASES = {
    "compile without options": (
        ["compile"],
        "ctxc: error: missing option '--context' (or '--contexts' for a JSON Lines file)",
    ),
    "unknown subcommand": (
        ["fancy"],
        "ctxc: error: no such command 'fancy'; commands: bake, compile, eval-bake, export, "
        "generate, inspect, route",
    ),
    "unknown update rule": (
        ["compile", "--context", "c.txt", "--update", "fancy"],
        "ctxc: error: invalid value for '--update': 'fancy' is not one of "
        "'standard', 'stable', 'output', 'lora'",
    ),
    "unknown dtype": (
        ["compile", "--context", "c.txt", "--dtype", "float64"],
        "ctxc: error: invalid value for '--dtype': 'float64' is not one of "
        "'float32', 'bfloat16', 'float16'",
    ),
    "non-integer start layer": (
        ["compile", "--context", "c.txt", "--start-layer", "abc"],
        "ctxc: error: invalid value for '--start-layer': 'abc' is not an integer",
    ),
    "a value for a flag": (
        ["compile", "--context", "c.txt", "--force", "yes"],
        "ctxc: error: unexpected argument 'yes' (flags such as --force take no value)",
    ),
    "unknown option": (
        ["compile", "--context", "c.txt", "--zzz"],
        "ctxc: error: no such option: --zzz",
    ),
    "unknown emitter": (
        ["compile", "--context", "c.txt", "--emit", "torch,tflite"],
        "ctxc: error: invalid value for '--emit': 'tflite'; expected a comma list of "
        "torch, onnx, ort-adapter, peft, lora, gguf, gguf-lora, safetensors-delta",
    ),
    "zero threads": (
        ["--threads", "0", "inspect"],
        "ctxc: error: invalid value for '--threads' (env var: 'CTXC_THREADS'): Input should be "
        "greater than or equal to 1",
    ),
    "export without --out": (
        ["export", "--patch", "p.safetensors"],
        "ctxc: error: missing option '--out'",
    ),
}


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text("w1 w2 w3")
    return tmp_path


@pytest.mark.parametrize("case", sorted(CASES))
def test_usage_error_is_one_line_and_exit_2(case, cwd, capsys) -> None:
    args, first = CASES[case]
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines == [first], captured.err
    assert sorted(p.name for p in cwd.iterdir()) == ["c.txt"]


def test_no_arguments_prints_help_and_exits_0(cwd, capsys) -> None:
    assert main([]) == 0
    captured = capsys.readouterr()
    assert "Usage: ctxc" in captured.out and "compile" in captured.out, captured.out
    assert captured.err == ""


def test_version(cwd, capsys) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"ctxc {__version__}\n"


def test_threads_set_torch_s_threads(cwd, capsys, monkeypatch) -> None:
    """``ctxc --threads N`` (or ``CTXC_THREADS``) sets torch's CPU threads before the command."""
    import torch

    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        assert main(["--threads", str(want), "inspect", "--help"]) == 0
        assert torch.get_num_threads() == want, (torch.get_num_threads(), want)
        torch.set_num_threads(before)
        monkeypatch.setenv("CTXC_THREADS", str(want))
        assert main(["inspect", "--help"]) == 0
        assert torch.get_num_threads() == want, (torch.get_num_threads(), want)
    finally:
        torch.set_num_threads(before)
    assert "Usage: ctxc inspect" in capsys.readouterr().out


def test_version_is_defined_once() -> None:
    from importlib.metadata import version

    assert version("ctxc") == __version__


def test_help_does_not_import_torch() -> None:
    # `ctxc --help` must stay well under a second: no torch/Transformers on its import path.
    code = (
        "import sys; from ctxc.cli.app import main; rc = main(['--help']); "
        "heavy = [m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules]; "
        "print(rc, heavy)"
    )
    env = {**os.environ}
    env.pop("CTXC_TEST_PAUSE_AT", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.stdout.splitlines()[-1] == "0 []", proc.stdout + proc.stderr


EXTRAS = {
    "onnx": (
        ["compile", "--context", "c.txt", "--emit", "torch,onnx"],
        "ctxc: error: --emit onnx needs onnx, onnxruntime, onnxscript: pip install 'ctxc[onnx]'",
    ),
    "peft": (
        ["export", "--patch", "p.safetensors", "--to", "peft", "--out", "x"],
        "ctxc: error: --to peft needs peft: pip install 'ctxc[peft]'",
    ),
}


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_missing_extra_is_one_line_before_any_work(extra, cwd, capsys, monkeypatch) -> None:
    for name in extras.EXTRAS[extra]:  # as if the extra were not installed
        monkeypatch.setitem(sys.modules, name, None)
    args, first = EXTRAS[extra]
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines() == [first]
    assert sorted(p.name for p in cwd.iterdir()) == ["c.txt"]
