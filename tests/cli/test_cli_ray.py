"""``ctxc compile --contexts --engine ray`` (issue 26): the lines on a Ray actor pool.

The quick tests need no Ray (the options, and the one line a missing ``ray`` gives). The others
start one local Ray for the module (2 CPUs; 1-2 workers of the tiny model) and check that every
folder is byte for byte the local run's, that a worker killed with SIGKILL inside a line (held
there by ``CTXC_TEST_PAUSE_AT``) costs no line and writes none twice, and that an interrupted
run resumes to the uninterrupted result; they skip, saying so, where ray is not installed
(``pip install 'ctxc[ray]'``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures.helpers import run_cli

ROWS = [
    {"context": "w5 w6 w7 w8 w9", "name": "first"},
    {"context": "w10 w11 w12 w13", "query": "w14 w15"},
    {"context": "w20 w21 w22 w23 w24 w25", "query": "w26", "name": "third.v1"},
    {"context": "w30 w31 w32 w33", "name": "fourth"},
    {"context": "w40 w41 w42 w43 w44", "query": "w45", "name": "fifth"},
    {"context": "w50 w51 w52", "name": "sixth"},
]
NAMES = ["first", "0002", "third.v1", "fourth", "fifth", "sixth"]
# A line only the model refuses (past the tiny model's 256 positions): an error of its own line
# (a line bad as written refuses the whole file before anything runs: test_cli_batch.py).
LONG = {"context": " ".join(f"w{i % 90 + 4}" for i in range(300)), "name": "long"}


def _jsonl(folder: Path, rows: list) -> Path:
    path = folder / "c.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _args(model_dir: Path, folder: Path, out: str, *extra: str) -> list[str]:
    contexts = str(folder / "c.jsonl")
    return ["compile", "--model", str(model_dir), "--contexts", contexts, "--out", out, *extra]


def _ray(folder: Path, model_dir: Path, out: str, *extra: str) -> list[str]:
    return _args(model_dir, folder, str(folder / out), "--engine", "ray", "--workers", "1", *extra)


def _same_folders(ours: Path, local: Path, names: list[str]) -> None:
    """Every file of every line byte-identical to the local run's but the run's own records
    (report.json's wall times, the markers)."""
    for name in names:
        files = sorted(
            p.relative_to(local / name)
            for p in (local / name).rglob("*")
            if p.is_file() and p.name not in ("report.json", ".ctxc")
        )
        assert files, f"{local / name} is empty"
        differ = [
            f for f in files if (ours / name / f).read_bytes() != (local / name / f).read_bytes()
        ]
        assert not differ, f"{name}: {differ} differ from the local run's"
        report = json.loads((ours / name / "report.json").read_text())
        expected = json.loads((local / name / "report.json").read_text())
        report.pop("timings"), expected.pop("timings")
        assert report == expected, name


# --- without Ray --------------------------------------------------------------------------


def test_missing_ray_is_one_line(tmp_path, monkeypatch) -> None:
    """ray not importable: one line naming the extra, exit 2, nothing written."""
    monkeypatch.setitem(sys.modules, "ray", None)  # ``import ray`` raises ImportError
    _jsonl(tmp_path, ROWS[:1])
    run = run_cli(*_args(Path("unused"), tmp_path, str(tmp_path / "out"), "--engine", "ray"))
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        "ctxc: error: --engine ray needs ray: pip install 'ctxc[ray]'"
    ], run.stderr
    assert not (tmp_path / "out").exists()


def test_missing_ray_from_python(tmp_path, monkeypatch) -> None:
    import ctxc

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ctxc.CtxcError, match=r"needs ray: pip install 'ctxc\[ray\]'"):
        ctxc.compile_many(ROWS[:1], tmp_path / "out", engine="ray")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--workers", "2"], "--workers applies to --engine ray"),
        (["--address", "auto"], "--address applies to --engine ray"),
        (["--gpus-per-worker", "1"], "--gpus-per-worker applies to --engine ray"),
        (["--engine", "ray", "--workers", "0"], "--workers must be at least 1, not 0"),
        (["--engine", "cluster"], "invalid value for '--engine': 'cluster' is not one of"),
    ],
)
def test_engine_options_are_checked(tmp_path, extra, message) -> None:
    _jsonl(tmp_path, ROWS[:1])
    run = run_cli(*_args(Path("unused"), tmp_path, str(tmp_path / "out"), *extra))
    assert run.returncode == 2, run.stderr
    assert message in run.stderr, run.stderr
    assert not (tmp_path / "out").exists()


def test_engine_applies_to_contexts(tmp_path) -> None:
    (tmp_path / "c.txt").write_text("w1 w2")
    run = run_cli("compile", "--context", str(tmp_path / "c.txt"), "--engine", "ray")
    assert (run.returncode, run.stderr.strip()) == (
        2,
        "ctxc: error: --engine applies to --contexts",
    )


# --- on a local Ray -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """A local Ray of 2 CPUs for the module; its workers are this process's descendants."""
    ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'ctxc[ray]'")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def local(tiny_model_dir, tmp_path_factory) -> Path:
    """The local run of the six lines (and one the model refuses), for comparison."""
    work = tmp_path_factory.mktemp("local")
    _jsonl(work, [*ROWS[:3], LONG, *ROWS[3:]])
    run = run_cli(*_args(tiny_model_dir, work, str(work / "out")))
    assert run.returncode == 1, run.stderr
    return work / "out"


@pytest.mark.slow  # starts a local Ray
def test_ray_run_is_byte_identical_to_the_local_run(cluster, local, tiny_model_dir, tmp_path):
    """From Python (the command's own run): 5 workers asked of 2 CPUs give 2; every folder and
    index.json byte for byte the local run's, the bad line an error of its own."""
    import ctxc

    path = _jsonl(tmp_path, [*ROWS[:3], LONG, *ROWS[3:]])
    out = tmp_path / "out"
    rows = ctxc.compile_many(path, out, model=str(tiny_model_dir), engine="ray", workers=5)
    assert [r["status"] for r in rows] == ["ok"] * 3 + ["error"] + ["ok"] * 3, rows
    assert rows[3]["error"].startswith("context + query is 301 tokens"), rows[3]
    _same_folders(out, local, NAMES)
    assert (out / "index.json").read_bytes() == (local / "index.json").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in local.iterdir())
    assert cluster.is_initialized()  # a Ray the caller started is left running
    with pytest.raises(ctxc.CtxcError, match="engine must be 'local' or 'ray'"):
        ctxc.compile_many(ROWS[:2], out, engine="spark")


def _kill_paused(pid_file: Path, seen: list[int]) -> threading.Thread:
    """A thread that waits for the worker paused inside its line to write its pid
    (``CTXC_TEST_PAUSE_ONCE``), then kills that process with SIGKILL (recorded in ``seen``)."""

    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            text = pid_file.read_text() if pid_file.is_file() else ""
            if text.endswith("\n"):
                seen.append(int(text))
                os.kill(seen[0], signal.SIGKILL)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow  # starts a local Ray
def test_killed_worker_loses_no_line(cluster, local, tiny_model_dir, tmp_path, monkeypatch):
    """SIGKILL to the worker compiling line ``first`` (held there by the test hook): the line
    is retried by the worker that replaces it, every line once, the loss in index.json, the
    folders the local run's."""
    _jsonl(tmp_path, [*ROWS[:3], LONG, *ROWS[3:]])
    out, killed, pid_file = tmp_path / "out", [], tmp_path / "paused.pid"
    monkeypatch.setenv("CTXC_TEST_PAUSE_AT", "compiling first")  # the workers are given it
    monkeypatch.setenv("CTXC_TEST_PAUSE_ONCE", str(pid_file))  # the retry goes on
    watcher = _kill_paused(pid_file, killed)
    run = run_cli(*_ray(tmp_path, tiny_model_dir, "out"))
    watcher.join(timeout=5)
    assert killed, "no worker paused in line first"
    assert run.returncode == 1, run.stderr
    index = json.loads((out / "index.json").read_text())
    assert [r["name"] for r in index] == ["first", "0002", "third.v1", "long", *NAMES[3:]]
    assert [r["status"] for r in index] == ["ok"] * 3 + ["error"] + ["ok"] * 3
    assert [r["name"] for r in index if r.get("attempts")] == ["first"], index
    assert index[0]["attempts"] == 2, index[0]
    assert index[0]["workers_lost"][0].startswith(f"worker pid {killed[0]} lost"), index[0]
    assert not [p.name for p in out.iterdir() if ".partial-" in p.name]
    _same_folders(out, local, NAMES)


def _interrupt_after(out: Path, name: str) -> None:
    """SIGINT to this process once index.json lists line ``name`` as done (the driver is
    paused there by ``CTXC_TEST_PAUSE_AT``)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            rows = json.loads((out / "index.json").read_text())
        except (OSError, ValueError):
            rows = []
        if any(r["name"] == name and r["status"] == "ok" for r in rows):
            os.kill(os.getpid(), signal.SIGINT)
            return
        time.sleep(0.05)


@pytest.mark.slow  # starts a local Ray
def test_interrupted_ray_run_resumes(cluster, local, tiny_model_dir, tmp_path, monkeypatch):
    """Ctrl-C after two lines: the workers end, no staging folder is left, the finished lines
    stay; --resume compiles only the others, and the result is the uninterrupted run's."""
    _jsonl(tmp_path, [*ROWS[:3], LONG, *ROWS[3:]])
    out = tmp_path / "out"
    monkeypatch.setenv("CTXC_TEST_PAUSE_AT", "line 2 done")  # the driver's stage
    watcher = threading.Thread(target=_interrupt_after, args=(out, "0002"), daemon=True)
    watcher.start()
    run = run_cli(*_ray(tmp_path, tiny_model_dir, "out"))
    watcher.join(timeout=5)
    assert run.returncode == 130, run.stderr
    assert not [p.name for p in out.iterdir() if ".partial-" in p.name]
    kept = {r["name"]: r["status"] for r in json.loads((out / "index.json").read_text())}
    done = sorted(n for n in NAMES if kept.get(n) == "ok")
    assert "0002" in done and len(done) < len(NAMES), kept
    stamps = {n: (out / n / "patch.safetensors").stat().st_mtime_ns for n in done}

    monkeypatch.delenv("CTXC_TEST_PAUSE_AT")
    run = run_cli(*_ray(tmp_path, tiny_model_dir, "out", "--resume"))
    assert run.returncode == 1, run.stderr
    assert {n: (out / n / "patch.safetensors").stat().st_mtime_ns for n in done} == stamps
    _same_folders(out, local, NAMES)
    assert (out / "index.json").read_bytes() == (local / "index.json").read_bytes()


@pytest.mark.tiny
def test_compile_many_here(local, tiny_model_dir, tmp_path):
    """``ctxc.compile_many`` without Ray: the command's run, its rows returned."""
    import ctxc

    rows = ctxc.compile_many(ROWS[:2], tmp_path / "out", model=str(tiny_model_dir))
    assert [(r["name"], r["status"]) for r in rows] == [("first", "ok"), ("0002", "ok")]
    assert json.loads((tmp_path / "out" / "index.json").read_text()) == rows
    _same_folders(tmp_path / "out", local, ["first", "0002"])
