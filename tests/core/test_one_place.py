"""One place per decision (issue 22): one text-file reader, one ``max_positions``, one
``report.json`` writer. In process; no model is built.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from ctxc.core.errors import CtxcError
from ctxc.core.textfile import read_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "good.txt").write_text("w1 w2\n")
    (tmp_path / "blank.txt").write_text(" \n\n")
    (tmp_path / "binary.txt").write_bytes(b"ok \xff\xfe")
    (tmp_path / "folder").mkdir()
    return {p.name: p for p in tmp_path.iterdir()} | {"missing": tmp_path / "missing.txt"}


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("missing", "query file not found: {}"),
        ("folder", "query file is not a file: {}"),
        ("blank.txt", "query file is empty: {}"),
        ("binary.txt", "query file is not UTF-8 text: {} (byte 3)"),
    ],
)
def test_the_reader_names_the_file(files, name, message) -> None:
    with pytest.raises(CtxcError) as caught:
        read_text(files[name], "query file")
    assert str(caught.value) == message.format(files[name])


def test_the_reader_keeps_the_text(files) -> None:
    assert read_text(files["good.txt"], "context file") == "w1 w2\n"


def _unreadable(monkeypatch, name: str) -> None:
    """Reading a file called ``name`` fails as a file without read permission does (as root,
    chmod cannot make one)."""
    real = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        if self.name == name:
            raise PermissionError(13, "Permission denied")
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)


# Every file a command reads: an unreadable one is a usage error (exit 2) naming the file, the
# --queries file too (it was an internal error, exit 1).
UNREADABLE = {
    "context": (["compile", "--context", "bad.txt"], "context file"),
    "contexts": (["compile", "--contexts", "bad.txt"], "contexts file"),
    "bake context": (["bake", "--context", "bad.txt"], "context file"),
    "bake queries": (["bake", "--context", "c.txt", "--queries", "bad.txt"], "query file"),
    "held-out queries": (["bake", "--context", "c.txt", "--eval-queries", "bad.txt"], "query file"),
    "eval-bake queries": (["eval-bake", "x", "--queries", "bad.txt"], "query file"),
    "generate context": (["generate", "--context", "bad.txt"], "context file"),
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_an_unreadable_file_is_exit_2_naming_it(case, tmp_path, monkeypatch, capsys) -> None:
    from ctxc.cli.app import main

    args, what = UNREADABLE[case]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text("w1 w2 w3")
    (tmp_path / "bad.txt").write_text("w1 w2 w3")
    _unreadable(monkeypatch, "bad.txt")
    assert main([*args, "--out", "out"] if args[0] != "eval-bake" else args) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"ctxc: error: cannot read {what} bad.txt: Permission denied"], lines
    assert not (tmp_path / "out").exists()


def test_max_positions_is_one_function_and_reads_a_text_config() -> None:
    """The export's bound and the length check read the same function: a multimodal model's
    text config counts (the export read only the top-level config before)."""
    from ctxc.frontend.trace import MAX_SEQ, longest_input
    from ctxc.models.load import max_positions

    text = SimpleNamespace(max_position_embeddings=512)
    vlm = SimpleNamespace(text_config=text, vision_config=SimpleNamespace(image_size=32))
    assert max_positions(vlm) == (512, "max_position_embeddings")
    assert longest_input(SimpleNamespace(config=vlm)) == 512
    assert longest_input(SimpleNamespace(config=SimpleNamespace(n_ctx=10**9))) == MAX_SEQ
    assert longest_input(SimpleNamespace(config=None)) == MAX_SEQ
    sources = [p.read_text() for p in ROOT.joinpath("compiler").rglob("*.py")]
    assert sum(len(re.findall(r"^def max_positions\(", s, re.M)) for s in sources) == 1


class _Figures:
    def to_dict(self) -> dict:
        return {"fidelity": 1e-6}


def test_one_report_writer(tmp_path) -> None:
    from ctxc.core.checks import ArtefactError
    from ctxc.core.report import write_report

    failed = ArtefactError("model.onnx", "model.onnx check failed: x")
    data = write_report(tmp_path, {"patch": "p"}, {"onnx": _Figures()}, failed)
    assert json.loads((tmp_path / "report.json").read_text()) == data
    assert data == {
        "patch": "p",
        "onnx": {"fidelity": 1e-6},
        "failed": {"artefact": "model.onnx", "error": "model.onnx check failed: x"},
    }
    nested = write_report(tmp_path, {"figures": {}}, {"torch": {"emitted": {}}}, under="artefacts")
    assert nested == {"figures": {}, "artefacts": {"torch": {"emitted": {}}}}
    # No other module writes a report.json by hand.
    writers = [
        str(p.relative_to(ROOT))
        for folder in ("compiler", "passes", "backends")
        for p in ROOT.joinpath(folder).rglob("*.py")
        if re.search(r"report\.json\"\)\.write_text|REPORT_FILE\)\.write_text", p.read_text())
    ]
    assert writers == ["compiler/core/report.py"], writers


def test_the_report_file_is_named_once() -> None:
    named = [
        str(p.relative_to(ROOT))
        for folder in ("compiler", "passes", "backends")
        for p in sorted(ROOT.joinpath(folder).rglob("*.py"))
        if '"report.json"' in p.read_text()
    ]
    assert named == ["compiler/core/vocabulary.py"], f"use REPORT_FILE instead: {named}"
