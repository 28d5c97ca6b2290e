"""Interrupts (issue 15.2): SIGINT/SIGTERM at each stage leave a clean disk, print
`ctxc: interrupted` and exit 128 + the signal; partial cache entries of dead runs are removed
on the next start, those of live runs are left alone.

The CLI runs in a subprocess that pauses at a named stage (``CTXC_TEST_PAUSE_AT``) and says so
on stderr, so the signal lands at that stage deterministically.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ctxc.cli.app import main
from ctxc.core.cache import clean_stale, partial_entry

pytestmark = pytest.mark.tiny

CONTEXT = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"


def _interrupted(args: list[str], stage: str, sig: int, cwd: Path, cache: Path):
    env = {**os.environ, "CTXC_TEST_PAUSE_AT": stage, "CTXC_CACHE": str(cache)}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ctxc.cli.app", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line == f"ctxc-test: paused at {stage}\n":
            proc.send_signal(sig)
            break
    else:
        proc.kill()
        pytest.fail(f"never paused at {stage}: {''.join(seen)}")
    rest = proc.stderr.read()
    proc.wait(timeout=120)
    return proc.returncode, [line for line in rest.splitlines() if line.strip()]


@pytest.fixture
def work(tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "context.txt").write_text(CONTEXT)
    return folder


@pytest.mark.parametrize(
    ("stage", "sig"),
    [
        ("loading", signal.SIGINT),
        ("solving", signal.SIGINT),
        ("writing", signal.SIGINT),
        ("writing", signal.SIGTERM),
    ],
)
def test_compile_interrupted_leaves_a_clean_disk(stage, sig, work, tiny_model_dir, warm_cache):
    args = ["compile", "--model", str(tiny_model_dir), "--context", "context.txt", "--out", "out"]
    rc, lines = _interrupted(args, stage, sig, work, warm_cache)
    assert rc == 128 + sig, lines
    assert lines == ["ctxc: interrupted"]
    assert sorted(p.name for p in work.iterdir()) == ["context.txt"]


def test_interrupted_conversion_leaves_no_partial_cache_entry(work, tmp_path):
    (work / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    cache = tmp_path / "cache"
    args = ["compile", "--model", "model.gguf", "--context", "context.txt", "--out", "out"]
    rc, lines = _interrupted(args, "converting", signal.SIGINT, work, cache)
    assert rc == 130, lines
    assert lines[-1] == "ctxc: interrupted"
    assert list((cache / "converted").iterdir()) == []
    assert sorted(p.name for p in work.iterdir()) == ["context.txt", "model.gguf"]


def _stale(parent: Path, name: str) -> None:
    (parent / name).mkdir(parents=True)
    (parent / name / "model.safetensors").write_bytes(b"half")
    (parent / f"{name}.lock").write_text("999999999\n")  # a pid no process has


def test_stale_partial_entries_are_removed_and_live_ones_kept(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    converted = cache / "converted"
    _stale(converted, ".partial-999999999-dead")
    monkeypatch.setenv("CTXC_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "context.txt").write_text(CONTEXT)
    (tmp_path / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    with partial_entry(converted) as live:  # a concurrent run, holding its lock
        live.mkdir()
        args = ["compile", "--model", "model.gguf", "--context", "context.txt", "--out", "o"]
        assert main(args) == 2  # the fake GGUF does not load; the start cleaned up first
        # The progress trail's seconds aside (compiler/cli/progress.py), line by line.
        lines = [re.sub(r" \(\d+\.\d s\)$", "", x) for x in capsys.readouterr().err.splitlines()]
        assert lines[0] == "ctxc: loading model.gguf, float32"
        # The first run says the conversion is one-time and shows its steps.
        assert lines[1] == (
            f"ctxc: one-time conversion of model.gguf into {converted} "
            "(a few minutes; later loads take seconds)"
        )
        assert lines[2] == "ctxc: conversion 1/3: reading and de-quantising the GGUF tensors"
        assert lines[-1].startswith("ctxc: error: cannot read GGUF file"), lines
        names = sorted(p.name for p in converted.iterdir())
        assert names == [live.name, f"{live.name}.lock"]
    assert list(converted.iterdir()) == []


def test_a_lock_held_elsewhere_protects_the_entry(tmp_path):
    _stale(tmp_path, ".partial-1-live")
    fd = os.open(tmp_path / ".partial-1-live.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert clean_stale(tmp_path) == []
    finally:
        os.close(fd)
    assert clean_stale(tmp_path) == [".partial-1-live"]
    assert list(tmp_path.iterdir()) == []
