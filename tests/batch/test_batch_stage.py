"""The batch run as a library stage (issue 37): errors name its parameters, the CLI prints the
flags; it prints nothing itself and reports through its hooks.

Every test but the last builds no model: the errors come before the load.
"""

from __future__ import annotations

import json

import pytest

from ctxc.batch import BatchHooks, run_batch
from ctxc.batch.ray_engine import RayEngine
from ctxc.cli.options import cli_message
from ctxc.core.errors import CtxcError

ROWS = [{"context": "w1 w2 w3", "name": "a"}, {"context": "w4 w5", "query": "w6", "name": "b"}]

# (the call, its message from Python, the same error as the command prints it)
CASES = [
    (
        lambda _: RayEngine(workers=0),
        "workers must be at least 1, not 0",
        "--workers must be at least 1, not 0",
    ),
    (
        lambda _: RayEngine(gpus_per_worker=-1.0),
        "gpus_per_worker must be 0 or more, not -1.0",
        "--gpus-per-worker must be 0 or more, not -1.0",
    ),
    (
        lambda out: _many(out, resume=True, force=True),
        "resume and force are exclusive: resume keeps the lines written, force starts afresh",
        "--resume and --force are exclusive: --resume keeps the lines written, --force starts "
        "afresh",
    ),
    (
        lambda out: _many(out, engine="cluster"),
        "engine must be 'local' or 'ray', not 'cluster'",
        "--engine must be 'local' or 'ray', not 'cluster'",
    ),
    (
        lambda out: _many(out, contexts=out.parent),
        "contexts takes a JSON Lines file; ",
        "--contexts takes a JSON Lines file; ",
    ),
]


def _many(out, contexts=None, **options):
    import ctxc

    return ctxc.compile_many(ROWS if contexts is None else contexts, out, **options)


@pytest.mark.parametrize(("call", "library", "cli"), CASES, ids=[c[1][:24] for c in CASES])
def test_errors_name_parameters_and_the_cli_its_flags(tmp_path, call, library, cli) -> None:
    out = tmp_path / "out"
    with pytest.raises(CtxcError) as caught:
        call(out)
    assert str(caught.value).startswith(library), str(caught.value)
    assert cli_message(caught.value).startswith(cli), cli_message(caught.value)
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_an_earlier_output_names_force(tmp_path, monkeypatch) -> None:
    """The output folder's own checks (shared with ``ctxc compile``) name ``out``/``force``."""
    import ctxc

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CtxcError) as caught:
        ctxc.compile_many(ROWS, ".")
    assert str(caught.value) == "out . is the current folder: name a new folder for the output"
    assert cli_message(caught.value).startswith("--out . is the current folder"), caught.value


@pytest.mark.tiny
def test_a_run_reports_through_its_hooks_and_prints_nothing(tiny_model_dir, tmp_path, capfd):
    """Two good lines and one the model refuses (past its positions): the counts and the error
    come through the hooks, in order; ctxc prints nothing (Transformers' own loading bars are
    the caller's to silence, as with ``ctxc.compile``)."""
    from ctxc.batch.job import CompileJob
    from ctxc.core.options import CompileOptions

    calls: list[tuple] = []
    hooks = BatchHooks(
        on_stage=lambda text, keep: calls.append(("stage", text)),
        on_lines=lambda done, total, kept: calls.append(("lines", done, total, kept)),
        on_error=lambda n, problem: calls.append(("error", n)),
    )
    long = {"context": " ".join(["w1"] * 5000), "name": "long"}
    lines = [json.dumps(r) for r in (ROWS[0], long, ROWS[1])]
    job = CompileJob(CompileOptions(), ["torch"])
    rows = run_batch(lines, tmp_path / "out", (str(tiny_model_dir), "float32"), job, hooks=hooks)
    assert [r["status"] for r in rows] == ["ok", "error", "ok"], rows
    assert calls == [
        ("lines", 0, 3, False),
        ("lines", 1, 3, False),
        ("error", 2),
        ("lines", 2, 3, False),
        ("lines", 3, 3, False),
    ], calls
    printed = capfd.readouterr()
    ours = [line for line in printed.err.splitlines() if "ctxc" in line or "line 2" in line]
    assert (printed.out, ours) == ("", []), printed
