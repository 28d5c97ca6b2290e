"""``--contexts`` keeps what finished (issue 20, item 3): an interrupt after k of n lines keeps
the k folders and index.json, ``--resume`` finishes the rest byte for byte as an uninterrupted
run, a damaged folder is compiled again, and an error on one line is that line's alone."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.cli.test_cli_races import _finish, _start, _wait_paused
from tests.fixtures.helpers import run_cli

pytestmark = pytest.mark.tiny

ROWS = [
    {"context": "w5 w6 w7 w8 w9", "name": "first"},
    {"context": "w10 w11 w12 w13", "query": "w14 w15"},
    {"context": "w20 w21 w22 w23 w24 w25", "query": "w26", "name": "third.v1"},
    {"context": "w30 w31 w32 w33", "name": "fourth"},
]
NAMES = ["first", "0002", "third.v1", "fourth"]


def _jsonl(folder: Path, rows: list[dict]) -> Path:
    path = folder / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _args(model_dir: Path, out: str, *extra: str) -> list[str]:
    return ["compile", "--model", str(model_dir), "--contexts", "c.jsonl", "--out", out, *extra]


def _report(folder: Path) -> dict:
    data = json.loads((folder / "report.json").read_text())
    data.pop("timings")  # wall times: the only figures that differ between runs
    return data


@pytest.fixture(scope="module")
def whole(tiny_model_dir, tmp_path_factory) -> Path:
    """An uninterrupted run of the four lines."""
    work = tmp_path_factory.mktemp("whole")
    _jsonl(work, ROWS)
    run = run_cli(*_args(tiny_model_dir, "out"), cwd=work)
    assert run.returncode == 0, run.stderr
    return work / "out"


def test_interrupted_after_k_lines_then_resumed_is_byte_identical(
    whole, tiny_model_dir, warm_cache, tmp_path
):
    # The interrupted run loads the tiny model's graph from warm_cache instead of exporting it.
    _jsonl(tmp_path, ROWS)
    proc = _start(_args(tiny_model_dir, "out"), tmp_path, warm_cache, "line 2 done")
    _wait_paused(proc, "line 2 done")
    proc.send_signal(signal.SIGINT)
    rc, lines = _finish(proc)
    assert (rc, lines) == (
        130,
        [
            "ctxc: interrupted; 2 of 4 contexts kept in out/; rerun with --resume to compile "
            "the rest"
        ],
    )  # what is kept, where, and how to go on (issue 34)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [".ctxc", "0002", "first", "index.json"]
    index = json.loads((out / "index.json").read_text())
    assert [r["status"] for r in index] == ["ok", "ok", "not run", "not run"]
    assert index[:2] == json.loads((whole / "index.json").read_text())[:2]

    # A rerun needs --resume, with the same options (refused before the model loads).
    run = run_cli(*_args(tiny_model_dir, "out"), cwd=tmp_path)
    assert (run.returncode, run.stderr.splitlines()) == (
        2,
        [
            "ctxc: error: output folder out holds an earlier ctxc output (--force replaces "
            "it; --resume keeps its finished lines)"
        ],
    )
    run = run_cli(*_args(tiny_model_dir, "out", "--resume", "--update", "standard"), cwd=tmp_path)
    assert (run.returncode, run.stderr.splitlines()) == (
        2,
        [
            "ctxc: error: --resume: output folder out was compiled with other options (update "
            "'stable', now 'standard'): give the same options, or --force to start afresh"
        ],
    )

    # Damage the first line's patch (one byte of its tensors): that line is compiled again.
    kept_marker = (out / "0002" / ".ctxc").read_bytes()
    damaged = bytearray((out / "first" / "patch.safetensors").read_bytes())
    damaged[-1] ^= 0x01
    (out / "first" / "patch.safetensors").write_bytes(bytes(damaged))
    run = run_cli(*_args(tiny_model_dir, "out", "--resume"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "compiled 4 of 4 contexts" in run.stdout
    assert (out / "0002" / ".ctxc").read_bytes() == kept_marker, "a finished line was redone"
    assert (out / "index.json").read_bytes() == (whole / "index.json").read_bytes()
    for name in NAMES:
        got, want = out / name, whole / name
        assert (got / "patch.safetensors").read_bytes() == (
            want / "patch.safetensors"
        ).read_bytes(), name
        assert _report(got) == _report(want), name
    assert sorted(p.name for p in out.iterdir()) == sorted([".ctxc", "index.json", *NAMES])


def test_an_unexpected_error_is_that_lines_alone(tiny_model_dir, tmp_path, monkeypatch):
    import ctxc.batch.line as batch_line

    real = batch_line.compile_into

    def broken(net, tokenizer, tmp, text, *args, **kwargs):
        if text == ROWS[1]["context"]:
            raise RuntimeError("boom\nsecond line")
        return real(net, tokenizer, tmp, text, *args, **kwargs)

    monkeypatch.setattr(batch_line, "compile_into", broken)
    _jsonl(tmp_path, ROWS[:3])
    run = run_cli(*_args(tiny_model_dir, "out"), cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    assert run.stderr.splitlines() == [
        "ctxc: error: line 2: internal error: RuntimeError: boom second line",
        f"compiled 2 of 3 contexts; 1 failed (see {Path('out') / 'index.json'})",
    ]
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert [r["status"] for r in index] == ["ok", "error", "ok"]
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == [".ctxc", "first", "index.json", "third.v1"]


def test_a_failed_check_keeps_the_lines_patch_and_resume_retries(
    tiny_model_dir, tmp_path, monkeypatch
):
    _jsonl(tmp_path, ROWS[:1])
    monkeypatch.setenv("CTXC_TEST_FAIL_CHECK", "torch")
    run = run_cli(*_args(tiny_model_dir, "out"), cwd=tmp_path)
    assert run.returncode == 1, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith(
        "ctxc: error: line 1: model/ check failed: max |logit diff| from the full context"
    ), lines
    assert lines[0].endswith(
        "forced by CTXC_TEST_FAIL_CHECK=torch); the patch and what passed are kept in "
        "out/first.failed/"
    ), lines
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [".ctxc", "first.failed", "index.json"]
    kept = out / "first.failed"
    assert sorted(p.name for p in kept.iterdir()) == [".ctxc", "patch.safetensors", "report.json"]
    assert json.loads((kept / "report.json").read_text())["failed"]["artefact"] == "model/"
    monkeypatch.delenv("CTXC_TEST_FAIL_CHECK")
    run = run_cli(*_args(tiny_model_dir, "out", "--resume"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == [".ctxc", "first", "index.json"]
