"""``ctxc compile --contexts FILE.jsonl`` (issue 11): many contexts, one model load and trace."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.fixtures.helpers import run_cli

pytestmark = pytest.mark.tiny

GOOD = [
    {"context": "w5 w6 w7 w8 w9", "name": "first"},
    {"context": "w10 w11 w12 w13", "query": "w14 w15"},
    {"context": "w20 w21 w22 w23 w24 w25", "query": "w26", "name": "third.v1"},
]
HEADLINE = ("max_abs_logit_diff", "total_variation", "top1_match")


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _single(tiny_model_dir: Path, tmp: Path, row: dict) -> Path:
    """A separate ``ctxc compile`` of one context (and query), for comparison."""
    (tmp / "c.txt").write_text(row["context"])
    out = tmp / f"single-{row.get('name', 'x')}"
    args = ["compile", "--context", str(tmp / "c.txt"), "--model", str(tiny_model_dir)]
    args += ["--out", str(out)] + (["--query", row["query"]] if "query" in row else [])
    assert run_cli(*args).returncode == 0
    return out


@pytest.fixture(scope="module")
def mixed(tiny_model_dir, tmp_path_factory):
    """3 good lines and 2 the model refuses (contexts past its 256 positions; a line bad as
    written refuses the whole file: test_bad_lines_refuse_the_file_before_the_model_loads)."""
    tmp = tmp_path_factory.mktemp("batch")
    long = [f"w{i % 90 + 4}" for i in range(300)]
    first, second = {"context": " ".join(long[:-1])}, {"context": " ".join(long), "name": "long"}
    rows = [GOOD[0], first, GOOD[1], second, GOOD[2]]
    out = tmp / "out"
    run = run_cli(
        "compile",
        "--contexts",
        str(_write(tmp / "c.jsonl", rows)),
        "--model",
        str(tiny_model_dir),
        "--out",
        str(out),
    )
    return tmp, out, run


def test_lines_the_model_refuses_are_reported_and_the_others_run(mixed) -> None:
    _, out, run = mixed
    assert run.returncode == 1, run.stderr
    lines = run.stderr.splitlines()
    assert lines[0].startswith("ctxc: error: line 2: context + query is 300 tokens;"), lines
    assert lines[1].startswith("ctxc: error: line 4: context + query is 301 tokens;")
    assert lines[-1] == f"compiled 3 of 5 contexts; 2 failed (see {out / 'index.json'})"
    assert sorted(p.name for p in out.iterdir()) == [
        ".ctxc",
        "0003",
        "first",
        "index.json",
        "third.v1",
    ]
    assert not (out / "long").exists() and not (out / "0002").exists()


def test_index_lists_every_line(mixed) -> None:
    _, out, _ = mixed
    index = json.loads((out / "index.json").read_text())
    assert [(r["line"], r["name"], r["status"]) for r in index] == [
        (1, "first", "ok"),
        (2, "0002", "error"),
        (3, "0003", "ok"),
        (4, "long", "error"),
        (5, "third.v1", "ok"),
    ]
    for row in index:
        if row["status"] == "ok":
            assert row["folder"] == row["name"]
            assert set(row) >= {*HEADLINE, "control"}
            assert "max_abs_logit_diff" in row["control"]
        else:
            assert "\n" not in row["error"] and "folder" not in row


def test_each_folder_matches_a_single_compile(mixed, tiny_model_dir) -> None:
    tmp, out, _ = mixed
    index = {r["name"]: r for r in json.loads((out / "index.json").read_text())}
    for row, name in zip(GOOD, ["first", "0003", "third.v1"], strict=True):
        single = _single(tiny_model_dir, tmp, row)
        got = out / name
        assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in single.iterdir())
        assert (got / "patch.safetensors").read_bytes() == (
            single / "patch.safetensors"
        ).read_bytes()
        mine = json.loads((got / "report.json").read_text())
        theirs = json.loads((single / "report.json").read_text())
        for key in (*HEADLINE, "control"):
            assert mine[key] == theirs[key], key
            if key != "control":
                assert index[name][key] == theirs[key]
        assert (
            index[name]["control"]["max_abs_logit_diff"]
            == (theirs["control"]["max_abs_logit_diff"])
        )


def test_all_good_exits_0(tiny_model_dir, tmp_path) -> None:
    src = _write(tmp_path / "c.jsonl", GOOD[:2])
    out = tmp_path / "out"
    run = run_cli(
        "compile", "--contexts", str(src), "--model", str(tiny_model_dir), "--out", str(out)
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    assert "compiled 2 of 2 contexts" in run.stdout
    index = json.loads((out / "index.json").read_text())
    assert [r["status"] for r in index] == ["ok", "ok"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "ctxc: error: missing option '--context' (or '--contexts' for a JSON Lines file)"),
        (
            ["--context", "c.txt", "--contexts", "c.jsonl"],
            "ctxc: error: --context and --contexts are mutually exclusive: give one",
        ),
    ],
    ids=["neither", "both"],
)
def test_context_and_contexts_exclusive(tmp_path, extra, message) -> None:
    (tmp_path / "c.txt").write_text("w1 w2")
    _write(tmp_path / "c.jsonl", [GOOD[0]])
    run = run_cli("compile", *extra, "--out", "out", cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [message]
    assert not (tmp_path / "out").exists()


def test_empty_file_is_a_usage_error(tmp_path) -> None:
    (tmp_path / "c.jsonl").write_text("\n  \n")
    run = run_cli("compile", "--contexts", "c.jsonl", "--out", "out", cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.splitlines() == ["ctxc: error: contexts file is empty: c.jsonl"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("line", "first"),
    [
        ('["w1"]', "not a JSON object"),
        ('{"context": "  "}', "missing or empty 'context'"),
        ('{"query": "w1"}', "missing or empty 'context'"),
        ('{"context": "w1", "name": "../x"}', "bad name '../x'"),
        ('{"context": "w1", "name": "a"}', "duplicate name 'a'"),
    ],
)
def test_bad_line_messages(tmp_path, line, first) -> None:
    from ctxc.batch.lines import read_lines

    src = tmp_path / "c.jsonl"
    src.write_text('{"context": "w1", "name": "a"}\n' + line + "\n")
    (_, entry, problem) = read_lines(src)[1]
    assert entry is None and problem.startswith(first), problem


def test_progress_shows_rate(capsys) -> None:
    """Contexts done of all and the rate, on the plain trail of a stderr that is no terminal."""
    from ctxc.cli.batch import batch_progress
    from ctxc.cli.progress import command_trail

    with command_trail(), batch_progress() as bar:
        task = bar.add_task("contexts", total=2)
        for _ in range(2):
            bar.update(task, advance=1)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("ctxc: contexts 0/2 ("), lines
    assert re.fullmatch(r"ctxc: contexts 2/2, [0-9.e+]+ contexts/s \(\d+\.\d s\)", lines[2]), lines


def test_interrupt_leaves_nothing(tiny_model_dir, warm_cache, tmp_path) -> None:
    """Ctrl-C while writing a context's folder: exit 130, no DIR, no staging folder. The run
    loads the tiny model's graph from ``warm_cache`` (as tests/cli/test_cli_interrupt.py's do)
    instead of exporting it: the interrupt comes after the trace either way."""
    import signal

    from tests.cli.test_cli_interrupt import _interrupted

    _write(tmp_path / "c.jsonl", GOOD[:2])
    args = ["compile", "--model", str(tiny_model_dir), "--contexts", "c.jsonl", "--out", "out"]
    rc, lines = _interrupted(args, "writing", signal.SIGINT, tmp_path, warm_cache)
    assert rc == 130, lines
    assert lines == ["ctxc: interrupted"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]
