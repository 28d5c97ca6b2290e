"""The CLI's shape (issue 22): one module per command, the shared options declared once, and
both ways of running it (``python -m ctxc.cli.app``, the ``ctxc`` script) kept."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ctxc import __version__

ROOT = Path(__file__).resolve().parents[2]


def test_one_module_per_command() -> None:
    from ctxc.cli.app import app

    where = {c.name: c.callback.__module__ for c in app.registered_commands if c.callback}
    assert where == {
        "compile": "ctxc.cli.compile",
        "export": "ctxc.cli.export",
        "inspect": "ctxc.cli.inspect",
        "generate": "ctxc.cli.generate",
        "bake": "ctxc.cli.bake",
        "eval-bake": "ctxc.cli.bake",
        "route": "ctxc.cli.route",
    }


def test_shared_options_are_declared_once() -> None:
    texts = {p.name: p.read_text() for p in ROOT.joinpath("compiler", "cli").glob("*.py")}
    for flag in ("--model", "--force", "--device", "--device-map", "--max-memory"):
        option = re.compile(r"typer\.Option\(\s*[^,()]+,\s*" + re.escape(f'"{flag}"'))
        found = {name: len(option.findall(text)) for name, text in texts.items()}
        assert {n: c for n, c in found.items() if c} == {"options.py": 1}, (flag, found)


def test_every_artefact_option_lists_every_backend() -> None:
    """Each command's ``--emit``/``--to`` help is ``emit_help``'s: every registered backend and
    what it writes, so a new backend shows in every command's help without a line there."""
    import typer

    from ctxc.backends import BACKENDS
    from ctxc.cli.app import app

    group = typer.main.get_command(app)
    found = {}
    for name, command in group.commands.items():
        for param in command.params:
            if {"--emit", "--to"} & set(param.opts):
                found[name] = [
                    f"{k} ({b.writes})"
                    for k, b in BACKENDS.items()
                    if f"{k} ({b.writes})" not in (param.help or "")
                ]
    assert {"compile", "export"} <= set(found), found
    assert not any(found.values()), f"--emit/--to help leaves out backends: {found}"


def test_python_m_and_the_script_run_main_then_exit_promptly() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ctxc.cli.app", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stdout) == (0, f"ctxc {__version__}\n"), proc.stderr
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]\n")[1]
    assert scripts.split("\n\n")[0].strip() == 'ctxc = "ctxc.cli.app:run"', scripts[:200]
    # A usage error keeps its status through run()'s exit, and its line reaches the pipe.
    proc = subprocess.run(
        [sys.executable, "-m", "ctxc.cli.app", "compile", "--context", str(ROOT / "missing.txt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.strip().endswith("missing.txt"), proc.stderr
