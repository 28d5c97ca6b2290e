"""Nothing lost (issue 20, items 1-2): two runs into one ``--out``, and a file put into it
while a compile runs.

Real ``ctxc`` processes that pause at a named stage (``CTXC_TEST_PAUSE_AT``): at ``placing``
their output is complete and not yet moved into place, so both runs of a race truly overlap
there; SIGUSR1 lets a paused run go on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

pytestmark = pytest.mark.tiny

CONTEXTS = {
    "a.txt": "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12",
    "b.txt": "w20 w21 w22 w23 w24 w25 w26 w27 w28",
}


def _start(args: list[str], cwd: Path, cache: Path, pause: str) -> subprocess.Popen:
    env = {**os.environ, "CTXC_TEST_PAUSE_AT": pause, "CTXC_CACHE": str(cache)}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "ctxc.cli.app", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_paused(proc: subprocess.Popen, stage: str) -> None:
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.endswith(f"ctxc-test: paused at {stage}\n"):
            return
    proc.kill()
    pytest.fail(f"never paused at {stage}: {''.join(seen)}")


def _finish(proc: subprocess.Popen) -> tuple[int, list[str]]:
    assert proc.stderr is not None
    rest = proc.stderr.read()
    proc.wait(timeout=300)
    return proc.returncode, [line for line in rest.splitlines() if line.strip()]


def _context_ids(folder: Path) -> list[int]:
    with safe_open(str(folder / "patch.safetensors"), framework="pt") as f:
        return json.loads(f.metadata()["context_ids"])


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def cache(warm_cache) -> Path:
    """The tiny model's export written once (``warm_cache``): the races under test are over the
    output folder; two processes racing on an empty cache are tests/store/test_export_cache.py's."""
    return warm_cache


@pytest.fixture
def work(tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    for name, text in CONTEXTS.items():
        (folder / name).write_text(text)
    return folder


def _compile(model_dir: Path, context: str, *extra: str) -> list[str]:
    return ["compile", "--model", str(model_dir), "--context", context, "--out", "out", *extra]


def _race(work: Path, model_dir: Path, cache: Path, *extra: str):
    """Two compiles of different contexts into ``out``, both held at ``placing`` and released
    together. Returns {context file: (exit status, stderr lines)}."""
    procs = {c: _start(_compile(model_dir, c, *extra), work, cache, "placing") for c in CONTEXTS}
    for proc in procs.values():
        _wait_paused(proc, "placing")
    for proc in procs.values():
        proc.send_signal(signal.SIGUSR1)
    return {c: _finish(proc) for c, proc in procs.items()}


def _ids_of(model_dir: Path, context: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(model_dir))(CONTEXTS[context]).input_ids)


@pytest.mark.parametrize("force", [False, True], ids=["new", "force"])
def test_two_compiles_into_one_folder_one_wins(force, work, tiny_model_dir, cache):
    if force:  # an earlier output both may replace: only the first to place does
        (work / "out").mkdir()
        (work / "out" / "generate.json").write_text("{}")  # an older ctxc output
    results = _race(work, tiny_model_dir, cache, *(["--force"] if force else []))
    rcs = sorted(rc for rc, _ in results.values())
    assert rcs == [0, 2], results
    winner = next(c for c, (rc, _) in results.items() if rc == 0)
    loser = next(c for c, (rc, _) in results.items() if rc == 2)
    assert results[loser][1] == [
        "ctxc: error: output folder out was written by another ctxc run while this run wrote "
        "its output: out was left as it is and this run's output is in out.unplaced/"
    ]
    out = work / "out"
    # The winner's complete output is in place; the loser's, complete too, beside it.
    assert _entries(out) == [".ctxc", "model", "patch.safetensors", "report.json"]
    assert _context_ids(out) == _ids_of(tiny_model_dir, winner)[:-1]
    kept = work / "out.unplaced"
    assert _entries(kept) == [".ctxc", "model", "patch.safetensors", "report.json"]
    assert _context_ids(kept) == _ids_of(tiny_model_dir, loser)[:-1]
    assert sorted(p.name for p in work.iterdir()) == ["a.txt", "b.txt", "out", "out.unplaced"]


def test_a_file_put_into_out_during_a_compile_is_never_deleted(work, tiny_model_dir, cache):
    proc = _start(_compile(tiny_model_dir, "a.txt"), work, cache, "placing")
    _wait_paused(proc, "placing")
    (work / "out").mkdir()
    (work / "out" / "notes.txt").write_text("notes")
    proc.send_signal(signal.SIGUSR1)
    rc, lines = _finish(proc)
    assert rc == 2, lines
    assert lines == [
        "ctxc: error: output folder out got files ctxc did not write ('notes.txt') while this "
        "run wrote its output: out was left as it is and this run's output is in out.unplaced/"
    ]
    assert _entries(work / "out") == ["notes.txt"]
    assert (work / "out" / "notes.txt").read_text() == "notes"
    assert _entries(work / "out.unplaced") == [".ctxc", "model", "patch.safetensors", "report.json"]
    assert sorted(p.name for p in work.iterdir()) == ["a.txt", "b.txt", "out", "out.unplaced"]


def test_force_never_deletes_a_file_put_into_the_earlier_output(work, tiny_model_dir, cache):
    out = work / "out"
    out.mkdir()
    (out / "generate.json").write_text("{}")  # an earlier ctxc output, which --force replaces
    (out / ".ctxc").write_text(json.dumps({"entries": ["generate.json"]}))
    proc = _start(_compile(tiny_model_dir, "a.txt", "--force"), work, cache, "placing")
    _wait_paused(proc, "placing")
    (out / "notes.txt").write_text("notes")
    proc.send_signal(signal.SIGUSR1)
    rc, lines = _finish(proc)
    assert rc == 2, lines
    assert len(lines) == 1 and "got files ctxc did not write ('notes.txt')" in lines[0], lines
    assert _entries(out) == [".ctxc", "generate.json", "notes.txt"]
    assert (out / "notes.txt").read_text() == "notes"


def test_a_second_contexts_run_into_a_held_folder_is_refused(work, tiny_model_dir, cache):
    rows = [{"context": CONTEXTS["a.txt"], "name": "a"}, {"context": CONTEXTS["b.txt"]}]
    (work / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["compile", "--model", str(tiny_model_dir), "--contexts", "c.jsonl", "--out", "out"]
    first = _start(args, work, cache, "line 1 done")
    _wait_paused(first, "line 1 done")
    for extra in ([], ["--resume"], ["--force"]):
        second = _start(args + extra, work, cache, "never")
        rc, lines = _finish(second)
        assert rc == 2 and lines == [
            "ctxc: error: output folder out is being written by another ctxc run"
        ], (extra, lines)
    first.send_signal(signal.SIGUSR1)
    rc, lines = _finish(first)
    assert rc == 0, lines
    index = json.loads((work / "out" / "index.json").read_text())
    assert [r["status"] for r in index] == ["ok", "ok"]
