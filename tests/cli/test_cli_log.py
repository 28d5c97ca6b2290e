"""Output read in a log (issue 20.4): results whole, a plain progress trail, no third-party noise.

The commands run in a fresh process with stdout and stderr piped (neither is a terminal) and
``COLUMNS=40``: every result line must come out whole, stderr must hold the plain trail and
nothing else. The trail itself is checked in process on a terminal and a non-terminal console.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ctxc.cli import progress as cli_progress
from ctxc.cli.progress import Counter, Trail, command_trail, finish, stage_progress
from testbed.tiny_models import VOCAB, build
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import TRAIL_LINE, run_cli

CONTEXT = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"
# What a line of third-party noise looks like: torch's logging (W1201 17:00:54.835 ...), a tqdm
# bar, Python's warnings, onnxruntime's log, Transformers' own lines.


def _ctxc(*args: str, cwd: Path, **more_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "40", "HF_HUB_OFFLINE": "1", **more_env}
    env.pop("CTXC_TEST_PAUSE_AT", None)
    for key in ("TQDM_DISABLE", "TRANSFORMERS_VERBOSITY", "TORCH_LOGS"):
        env.pop(key, None)  # the command sets what it needs itself
    return subprocess.run(
        [sys.executable, "-m", "ctxc.cli.app", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _trail_only(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    odd = [line for line in lines if not TRAIL_LINE.fullmatch(line)]
    assert not odd, f"stderr holds more than the progress trail: {odd[:5]}"
    return [re.sub(r" \(\d+\.\d s\)$", "", line) for line in lines]


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "context.txt").write_text(CONTEXT)
    return tmp_path


@pytest.mark.tiny
@needs_extra("peft")
def test_compile_into_a_log_prints_whole_lines_and_a_plain_trail(tiny_model_dir, work):
    proc = _ctxc(
        *("compile", "--model", str(tiny_model_dir), "--context", "context.txt"),
        *("--emit", "torch,peft", "--out", "out"),
        cwd=work,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # One line per figure, each whole although COLUMNS is 40: no line is a wrapped tail.
    starts = ("3/3 blocks patched", "max |logit diff|", "top-1 match", "reference: ")
    starts = (*starts, "peft: adapter/", "wrote")
    assert all(line.startswith(s) for line, s in zip(lines, starts, strict=True)), lines
    assert max(len(line) for line in lines) > 40, lines
    figures = lines[1]
    assert "total variation" in figures and figures.count("(unpatched: ") == 2, figures
    # The top-1 token's text beside its id (the tiny tokenizer's words are w<i>).
    assert re.match(r"top-1 match \(\d+ 'w\d+' vs full \d+ 'w\d+'; unpatched", lines[2]), lines[2]
    assert "floor" in lines[3] and "solver" in lines[3], lines[3]  # the figures' reference
    assert lines[4].endswith("top-1 match") and "LoRA pairs" in lines[4], lines[4]
    assert "0 LoRA parameters" not in lines[4] and "modules_to_save: 3 Gemma3RMSNorm" in lines[4]
    trail = _trail_only(proc.stderr)
    assert trail[0] == f"ctxc: loading {tiny_model_dir}, float32", trail
    for stage in ("tracing", "full run", "solving 3/3 blocks", "writing model/ and reloading it"):
        assert f"ctxc: {stage}" in trail, trail
    assert trail[-1] == "ctxc: done", trail
    assert len(trail) <= 20, trail


@pytest.mark.tiny
def test_generate_table_keeps_its_width_in_a_log(tiny_model_dir, work):
    proc = _ctxc(
        *("generate", "--model", str(tiny_model_dir), "--context", "context.txt"),
        *("--max-new-tokens", "3", "--out", "gen"),
        cwd=work,
    )
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("┃", "│"))]
    # A header and one row per step, each a whole row of the seven columns (wider than 40).
    assert len(rows) == 4, proc.stdout
    assert all(row.count(row[0]) == 8 and len(row) > 40 for row in rows), proc.stdout
    summary = [line for line in proc.stdout.splitlines() if line.startswith("top-1 match ")]
    assert len(summary) == 1 and "targets from" in summary[0], proc.stdout
    # Without the [plot] extra, one more line says generate.png was skipped and why.
    stderr = "\n".join(line for line in proc.stderr.splitlines() if "matplotlib" not in line)
    trail = _trail_only(stderr)
    assert "ctxc: generating 3/3 tokens" in trail, trail


def _merging_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE tokenizer with merges (``w`` + ``1`` -> ``w1``): a GGUF of it reads back into a
    Transformers tokenizer (one without merges needs scores the GGUF writer does not store)."""
    words = ["<pad>", "<bos>", "<eos>", "<unk>", "w", *"0123456789"]
    words += [f"w{d}" for d in range(1, 10)]
    words += [f"x{i}" for i in range(VOCAB - len(words))]
    merges = [("w", str(d)) for d in range(1, 10)]
    core = Tokenizer(models.BPE({w: i for i, w in enumerate(words)}, merges, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", **special)


@pytest.mark.tiny
def test_gguf_conversion_draws_no_bars_unless_verbose(work):
    """A .gguf --model is converted once: Transformers draws its de-quantising and loading bars
    (plain tqdm) meanwhile. Off unless -v."""
    folder = work / "llama"
    build("llama").save_pretrained(str(folder))
    _merging_tokenizer().save_pretrained(str(folder))
    args = ["--model", str(folder), "--context", "context.txt"]
    run = run_cli("compile", *args, "--update", "lora", "--emit", "gguf", "--out", "g", cwd=work)
    assert run.returncode == 0, run.stderr
    gguf = ["compile", "--model", "g/model.gguf", "--context", "context.txt"]
    quiet = _ctxc(*gguf, "--out", "o0", cwd=work, CTXC_CACHE=str(work / "c0"))
    # The second run's cache holds the first's export entry, not its converted model: it converts
    # again (its bars are the check), and loads the converted model's graph instead of tracing it.
    if (work / "c0" / "exports").is_dir():
        shutil.copytree(work / "c0" / "exports", work / "c1" / "exports")
    loud = _ctxc(*gguf, "--out", "o1", "-v", cwd=work, CTXC_CACHE=str(work / "c1"))
    assert quiet.returncode == 0, quiet.stderr
    trail = _trail_only(quiet.stderr)
    assert "ctxc: conversion 1/3: reading and de-quantising the GGUF tensors" in trail, trail
    assert loud.returncode == 0, loud.stderr
    for bar in ("de-quantizing GGUF tensors", "Loading weights"):
        assert bar in loud.stderr, loud.stderr[-2000:]


@pytest.mark.tiny
def test_plain_trail_is_a_line_per_stage_and_per_tenth() -> None:
    buf = io.StringIO()
    trail = Trail(Console(file=buf, width=40))
    assert not trail.live
    trail.stage("loading m, float32")
    for i in range(1, 101):
        trail.count("activity", i, 100, "solving", "blocks", detail=f"model.layers.{i}.mlp")
    trail.close(ok=True)
    lines = [re.sub(r" \(\d+\.\d s\)$", "", line) for line in buf.getvalue().splitlines()]
    assert lines == [
        "ctxc: loading m, float32",
        *(f"ctxc: solving {n}/100 blocks" for n in range(1, 101) if n == 1 or n % 10 == 0),
        "ctxc: done",
    ], lines


@pytest.mark.tiny
def test_plain_trail_keeps_to_the_counter_inside_a_loop_and_no_done_after_a_failure(capsys):
    with command_trail(), Counter(rate="contexts/s") as bar:
        task = bar.add_task("contexts", total=3)
        for _ in range(3):
            with stage_progress("compiling", "solving") as (on_stage, on_block):
                on_stage("tracing")  # the stages of each item stay off the plain trail
                on_block(1, 1, "model.layers.0.mlp")
            bar.update(task, advance=1)
        finish(ok=False)  # as after an error: no "done"
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0].split(",")[0] for line in lines] == [
        "ctxc: contexts 0/3",
        "ctxc: contexts 1/3",
        "ctxc: contexts 2/3",
        "ctxc: contexts 3/3",
    ], lines
    assert all(TRAIL_LINE.fullmatch(line) for line in lines), lines


@pytest.mark.tiny
def test_terminal_display_is_one_display_without_none_counters(monkeypatch) -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100, color_system=None)
    monkeypatch.setattr(cli_progress, "err", console)  # the trail of every command goes there
    with command_trail() as trail:
        assert trail.live
        trail.stage("loading m, float32")
        trail.stage("solving")
        displays = {id(trail._display)}
        for i in range(1, 4):
            trail.count("activity", i, 3, "solving", "blocks", detail=f"model.layers.{i}.mlp")
            displays.add(id(trail._display))
        trail._display.refresh()
        trail.stage("writing model/ and reloading it")  # the stage after the solve
        displays.add(id(trail._display))
        with Counter() as bar:
            task = bar.add_task("contexts", total=2)
            bar.update(task, advance=1)
            displays.add(id(trail._display))
            trail._display.refresh()
        text = buf.getvalue()
    assert len(displays) == 1, "a second live display was started"
    assert "None" not in text, text[-500:]
    assert "3/3 blocks" in text and "1/2" in text, text[-500:]
    assert "ctxc: done" not in buf.getvalue()  # the terminal display is transient


@pytest.mark.tiny
def test_report_json_names_the_model_folder_absolute(tiny_model_dir, work):
    rel = os.path.relpath(tiny_model_dir, work)
    run = run_cli("compile", "--model", rel, "--context", "context.txt", "--out", "out", cwd=work)
    assert run.returncode == 0, run.stderr
    report = json.loads((work / "out" / "report.json").read_text())
    assert report["model"] == str(Path(tiny_model_dir).resolve()), report["model"]
