"""The README's commands as a user runs them from a clone (issue 34): the folders they write are
ignored by git, and the quick start prints the figures the README and docs/cli.md show (slow:
it runs the command on the bundled model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_the_readme_examples_outputs_are_ignored() -> None:
    """Every ``--out DIR`` of a README command (run in the clone) is in .gitignore: the
    examples leave about 1 GB each that git would otherwise list as untracked."""
    command = r"ctxc (?:compile|export|generate|bake)\b[^\n`]*?--out ([\w.-]+)(?=[\s`]|$)"
    outs = set(re.findall(command, README.read_text(), re.M))
    ignored = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()}
    assert len(outs) >= 6, f"the README's commands were not found: {sorted(outs)}"
    missing = sorted(d for d in outs if f"/{d}/" not in ignored)
    assert not missing, f"README output folders not in .gitignore: {missing}"


def _indented_block(text: str, after: str) -> list[str]:
    """The indented (code) lines that follow the first line holding ``after``, unindented."""
    lines = text[text.index(after) :].splitlines()[1:]
    while lines and not lines[0].strip():
        lines.pop(0)
    block = []
    for line in lines:
        if not line.startswith("    "):
            break
        block.append(line[4:])
    return block


def _short(value: str) -> str:
    """A printed figure as the README's table writes it: ``1.43e-05`` -> ``1.43e-5``."""
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", value)


@pytest.mark.slow
def test_quick_start_figures_are_what_the_command_prints(tmp_path) -> None:
    """The README's quick start (``ctxc compile --context examples/medium.txt --out out`` on
    the bundled model) prints what the README, its table and docs/cli.md's log example say, at
    the README's thread count. When the compile changes, regenerate the figures from the
    command and this passes again; it reads the documents, so it holds no figure itself."""
    import torch

    from tests.fixtures.helpers import run_cli

    text = README.read_text()
    threads = int(re.search(r"(\d+) CPU threads", text).group(1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        run = run_cli(
            "compile", "--context", str(ROOT / "examples" / "medium.txt"), "--out", str(tmp_path)
        )
    finally:
        torch.set_num_threads(before)
    assert run.returncode == 0, run.stderr
    printed = run.stdout.splitlines()[:4]
    regenerate = f"regenerate the documents' figures from what the command prints: {printed}"

    readme = _indented_block(text, "and printed its figures:")
    assert readme == printed, f"README's quick start says {readme}; {regenerate}"
    log = _indented_block((ROOT / "docs" / "cli.md").read_text(), "bundled model:")[1:5]
    assert log == printed, f"docs/cli.md's log example says {log}; {regenerate}"

    numbers = re.compile(r"context (\d+) tokens, query (\d+)").search(printed[0])
    emitted, unpatched = re.search(
        r"max \|logit diff\| (\S+) \(unpatched: (\S+)\)", printed[1]
    ).groups()
    floor, solver = re.search(r"its floor (\S+); solver (\S+)\)", printed[3]).groups()
    row = re.search(r"^\| `model/` reloaded, `examples/medium\.txt` \((\d+) tokens\) \| ([^|]+) \|",
                    text, re.M)  # fmt: skip
    assert row is not None, "README's table lost its examples/medium.txt row"
    want = (
        f"{_short(emitted)} (runtime floor {_short(floor)}, solver {_short(solver)}, "
        f"unpatched {unpatched})"
    )
    tokens = int(numbers.group(1)) + int(numbers.group(2))
    assert (int(row.group(1)), row.group(2).strip()) == (tokens, want), (
        f"README's table row says {row.group(1)} tokens, {row.group(2).strip()!r}; the command "
        f"prints {tokens} tokens, {want!r}"
    )
