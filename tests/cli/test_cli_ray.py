"""``ctxc compile --contexts --engine ray`` (issue 26): the lines on a Ray actor pool.

The tests here need no Ray: the options, the one line a missing ``ray`` gives, and the local
engine's ``compile_many``. The runs on a local Ray (every folder byte for byte the local run's,
a worker killed with SIGKILL inside a line costing no line and writing none twice, an
interrupted run resuming to the uninterrupted result) left the suite for its time (issue 33):
``python -m benchmarks.cost.ray_batch`` runs all three on the bundled model
(docs/cluster.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.fixtures.extras import needs_extra
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
        pytest.param(  # without ray, its line comes first
            ["--engine", "ray", "--workers", "0"],
            "--workers must be at least 1, not 0",
            marks=needs_extra("ray"),
        ),
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
def local(tiny_model_dir, tmp_path_factory) -> Path:
    """The local run of the six lines (and one the model refuses), for comparison."""
    work = tmp_path_factory.mktemp("local")
    _jsonl(work, [*ROWS[:3], LONG, *ROWS[3:]])
    run = run_cli(*_args(tiny_model_dir, work, str(work / "out")))
    assert run.returncode == 1, run.stderr
    return work / "out"


@pytest.mark.tiny
def test_compile_many_here(local, tiny_model_dir, tmp_path):
    """``ctxc.compile_many`` without Ray: the command's run, its rows returned."""
    import ctxc

    rows = ctxc.compile_many(ROWS[:2], tmp_path / "out", model=str(tiny_model_dir))
    assert [(r["name"], r["status"]) for r in rows] == [("first", "ok"), ("0002", "ok")]
    assert json.loads((tmp_path / "out" / "index.json").read_text()) == rows
    _same_folders(tmp_path / "out", local, ["first", "0002"])
