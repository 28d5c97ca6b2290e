"""What the tests share: random token ids, logits of a (patched) model, difference figures."""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tiny_models import VOCAB

from ctxc.patch import Patch

__all__ = [
    "TRAIL_LINE",
    "CliRun",
    "compile_then_check",
    "diff_msg",
    "full_logits",
    "logits",
    "max_diff",
    "random_ids",
    "run_cli",
    "without_trail",
]

# A line of the progress trail on a stderr that is not a terminal (compiler/cli/progress.py).
TRAIL_LINE = re.compile(r"ctxc: .* \(\d+\.\d s\)")


def without_trail(stderr: str) -> str:
    """``stderr`` less the progress trail's lines: what a command said besides its progress."""
    lines = stderr.splitlines(keepends=True)
    return "".join(line for line in lines if not TRAIL_LINE.fullmatch(line.rstrip("\n")))


def random_ids(seed: int, n: int, vocab: int = VOCAB) -> list[int]:
    """``n`` seeded token ids in ``[4, vocab)`` (below 4: the tiny tokenizer's specials)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def max_diff(got, want) -> float:
    """max |got - want| in float64 (tensors or arrays)."""
    return float((torch.as_tensor(got).double() - torch.as_tensor(want).double()).abs().max())


def diff_msg(what: str, got, want) -> str:
    """``what: max M mean A`` for an assertion message."""
    diff = (torch.as_tensor(got).double() - torch.as_tensor(want).double()).abs()
    return f"{what}: max {float(diff.max()):.3g} mean {float(diff.mean()):.3g}"


def logits(model: torch.nn.Module, ids: list[int], patch: Patch | None = None) -> torch.Tensor:
    """``model`` (with ``patch`` applied for the call, when given) on ``ids``: [n, vocab]."""
    with torch.no_grad():
        if patch is None:
            return model(input_ids=torch.tensor([ids])).logits[0]
        with patch.applied(model):
            return model(input_ids=torch.tensor([ids])).logits[0]


def full_logits(model: torch.nn.Module, patch: Patch) -> torch.Tensor:
    """The unpatched model fed the patch's context + query, at the query positions: [k, vocab]."""
    ids = patch.meta.context_ids + patch.meta.query_ids
    return logits(model, ids)[-len(patch.meta.query_ids) :]


@dataclass(frozen=True)
class CliRun:
    """What one in-process ``ctxc`` run returned and printed.

    Attributes:
        stderr: stderr less the progress trail (its errors and notes).
        trail: the progress trail's lines (``ctxc: solving 2/3 blocks (1.2 s)``), in order.
    """

    returncode: int
    stdout: str
    stderr: str
    trail: tuple[str, ...] = ()


def run_cli(*args: str, cwd: Path | None = None) -> CliRun:
    """``ctxc ARGS`` in this process (no 5-10 s of imports per call), from ``cwd``.

    ``ctxc.cli.app.main`` restores the signal handlers it installs and returns the exit status, so
    it runs inside a test exactly as the console script would.
    """
    from ctxc.cli.app import main

    stdout, stderr = io.StringIO(), io.StringIO()
    before = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = main(list(args))
    finally:
        os.chdir(before)
    raw = stderr.getvalue()
    trail = tuple(line for line in raw.splitlines() if TRAIL_LINE.fullmatch(line))
    return CliRun(rc, stdout.getvalue(), without_trail(raw), trail)


def compile_then_check(args: list[str], out: Path, check: str, base: Path) -> dict:
    """``ctxc compile ARGS --out OUT`` in a subprocess, then ``check`` in a plain one.

    ``check`` is a script run as ``python -c check OUT BASE`` in a process without ctxc
    imported (plain Transformers, as a user would load ``OUT/model``); its last stdout line is
    JSON, returned.
    """
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "ctxc.cli.app", "compile", *args, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    checked = subprocess.run(
        [sys.executable, "-c", check, str(out), str(base)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checked.returncode == 0, checked.stderr[-2000:]
    return json.loads(checked.stdout.strip().splitlines()[-1])
