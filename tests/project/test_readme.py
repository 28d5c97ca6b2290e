"""The README's commands as a user runs them from a clone (issue 34): the folders they write are
ignored by git. That the quick start prints the figures the README and docs/cli.md show:
tests/pipeline/test_real_gemma.py (beside the other runs of the bundled model)."""

from __future__ import annotations

import re
from pathlib import Path

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
