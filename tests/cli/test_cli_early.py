"""Refusals known from the options, the tokenizer or the input files come before the model loads
(issue 34): one line, exit 2, nothing written, in about a second.

Each test replaces the model loader with one that fails the test if it is called, so a refusal
that came after the load (the 25-300 s the issue measured) cannot pass. Quick tier: no model
is built (a model folder here holds a config and a tokenizer, no weights).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import run_cli

# A refusal before the load takes the CLI's imports and a tokenizer at most: seconds, where
# the load alone takes 25-30 s on the bundled model.
FAST = 15.0


@pytest.fixture
def no_load(monkeypatch) -> list[str]:
    """The model loader replaced by one that records the call and fails: the list of models
    it was asked for (empty when the refusal came first)."""
    import ctxc.models.load as load

    asked: list[str] = []

    def refuse(spec=None, *args, **kwargs):
        asked.append(str(spec))
        raise AssertionError(f"the model {spec!r} was loaded before the refusal")

    monkeypatch.setattr(load, "load_model", refuse)
    return asked


def _refused(args: list[str], cwd: Path, asked: list[str]) -> str:
    """Run ``ctxc ARGS`` in ``cwd``; assert exit 2, one line, no model load, nothing written
    but the inputs; return the line."""
    before = sorted(p.name for p in cwd.iterdir())
    clock = time.perf_counter()
    run = run_cli(*args, cwd=cwd)
    seconds = time.perf_counter() - clock
    lines = run.stderr.splitlines()
    assert asked == [], f"the model was loaded before the refusal: {asked}; stderr {lines}"
    assert run.returncode == 2, (run.returncode, lines)
    assert len(lines) == 1 and lines[0].startswith("ctxc: error: "), lines
    assert sorted(p.name for p in cwd.iterdir()) == before, "the refusal left files behind"
    assert seconds < FAST, f"refused after {seconds:.1f} s"
    return lines[0]


@pytest.mark.parametrize(
    ("emit", "update", "rule"),
    [
        # The extras' check comes first (parse_backends): without one, that is the line.
        pytest.param("lora", [], "stable", marks=needs_extra("peft")),
        ("torch,gguf-lora", ["--update", "output"], "output"),
        pytest.param(
            "onnx,ort-adapter,peft,lora,gguf,gguf-lora",
            ["--update", "standard"],
            "standard",
            marks=needs_extra("onnx", "peft"),
        ),
    ],
    ids=["lora-default-rule", "gguf-lora-output", "all-kinds-standard"],
)
def test_rule_and_emit_clash_is_refused_before_the_load(
    tmp_path, no_load, emit, update, rule
) -> None:
    (tmp_path / "c.txt").write_text("a context")
    args = ["compile", "--context", "c.txt", "--emit", emit, *update, "--out", "out"]
    line = _refused(args, tmp_path, no_load)
    kind = next(k for k in emit.split(",") if k in ("lora", "gguf-lora"))
    assert line == (
        f"ctxc: error: --emit {kind} holds linear weights only, and --update {rule} may change "
        "norm scales: compile with --update lora (it admits every --emit kind)"
    )


def test_the_lora_rule_admits_every_kind() -> None:
    """What the refusal tells the user to do is accepted: ``--update lora`` with all seven."""
    from ctxc.backends import BACKENDS, check_rules
    from ctxc.core.errors import CtxcError

    check_rules(list(BACKENDS), "lora")
    for rule in ("standard", "stable", "output"):
        check_rules([k for k in BACKENDS if k not in ("lora", "gguf-lora")], rule)
        with pytest.raises(CtxcError, match="compile with --update lora"):
            check_rules(["lora"], rule)


def test_lora_rule_clash_in_a_batch_is_refused_before_the_load(tmp_path, no_load) -> None:
    (tmp_path / "c.jsonl").write_text(json.dumps({"context": "a b"}) + "\n")
    args = ["compile", "--contexts", "c.jsonl", "--emit", "gguf-lora", "--out", "out"]
    assert "compile with --update lora" in _refused(args, tmp_path, no_load)


def _no_template_model(folder: Path) -> Path:
    """A model folder whose tokenizer has no chat template (a config, no weights)."""
    from testbed.tiny_models import tiny_tokenizer

    folder.mkdir()
    tiny_tokenizer().save_pretrained(str(folder))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


@pytest.mark.parametrize("command", ["compile", "generate"])
def test_chat_without_a_template_is_refused_before_the_load(tmp_path, no_load, command) -> None:
    model = _no_template_model(tmp_path / "model")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "system.txt").write_text("Be brief.\n")
    args = [command, "--chat", "--system", "system.txt", "--query", "w5", "--model", str(model)]
    line = _refused([*args, "--out", "out"], tmp_path / "work", no_load)
    assert line.startswith("ctxc: error: the model's tokenizer has no chat template"), line


def test_a_template_is_seen_in_the_tokenizer_files(tmp_path) -> None:
    """The fast look at the files (no tokenizer load) finds a template a tokenizer saves, so it
    never refuses a chat model; without one it answers False."""
    from ctxc.models.load import declares_chat_template
    from testbed.chat import chat_tokenizer

    for with_template in (True, False):
        folder = tmp_path / str(with_template)
        tok = chat_tokenizer("llama3")
        if not with_template:
            tok.chat_template = None
        tok.save_pretrained(str(folder))
        files = sorted(p.name for p in folder.iterdir())
        assert declares_chat_template(folder) is with_template, files


def test_bad_lines_refuse_the_file_before_the_model_loads(tmp_path, no_load) -> None:
    """Every line bad as written, listed in one line, before the model loads; a duplicate name
    names the line that has it first."""
    rows = [
        json.dumps({"context": "w1 w2", "name": "a"}),
        "{not json",
        json.dumps({"context": "w3"}),
        json.dumps({"context": "w4", "name": "a"}),
        json.dumps({"query": "w5"}),
        json.dumps({"context": "w6", "name": "../x"}),
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(rows) + "\n")
    line = _refused(["compile", "--contexts", "c.jsonl", "--out", "out"], tmp_path, no_load)
    assert line.startswith("ctxc: error: c.jsonl: 4 bad lines (nothing was run): line 2: not "), (
        line
    )
    for part in (
        "; line 4: duplicate name 'a' (line 1 has it); ",
        "; line 5: missing or empty 'context'",
        "; line 6: bad name '../x'",
    ):
        assert part in line, line


def test_compile_many_refuses_bad_lines_before_the_load(tmp_path, no_load) -> None:
    import ctxc

    with pytest.raises(ctxc.CtxcError, match=r"^contexts: 1 bad line \(nothing was run\): "):
        ctxc.compile_many([{"context": "w1"}, {"context": ""}], tmp_path / "out")
    assert no_load == [] and not (tmp_path / "out").exists()


@needs_extra("peft")  # without it, --to lora says so first
def test_export_to_lora_of_a_patch_with_a_norm_delta_is_refused_before_the_load(
    tmp_path, no_load
) -> None:
    """``ctxc export --to lora`` reads the patch first: a norm-scale delta cannot go into a
    serving LoRA, said before the model loads."""
    import torch

    from ctxc.patch import Delta, Patch, PatchMeta

    scale = Delta(param="model.layers.0.post_feedforward_layernorm.weight",
                  block="model.layers.0.mlp", vector=torch.ones(4))  # fmt: skip
    meta = PatchMeta({"arch": "a" * 64, "weights": "b" * 64}, [1, 5], [6], "stable", "float32", "0")
    Patch({scale.param: scale}, meta).save(tmp_path / "patch.safetensors")
    args = ["export", "--patch", "patch.safetensors", "--to", "lora", "--out", "x"]
    line = _refused(args, tmp_path, no_load)
    assert line == (
        "ctxc: error: --to lora holds linear weights only; this patch changes "
        "model.layers.0.post_feedforward_layernorm.weight (a norm scale or bias, from --update "
        "stable): compile with --update lora"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--chat", "--system", "system.txt"], "the model's tokenizer has no chat template"),
        (
            ["--chat", "--context", "system.txt", "--system", "system.txt"],
            "--chat takes the context as turns (--system, --document or --messages), not --context",
        ),
        (["--context", "system.txt", "--system", "system.txt"], "--system applies with --chat"),
        (["--chat"], "--chat needs --system, --document or --messages (the context)"),
        ([], "missing option '--context' (or --chat with --system, --document or --messages)"),
    ],
    ids=["no-template", "chat-and-context", "system-without-chat", "chat-alone", "nothing"],
)
def test_bake_chat_refusals_come_before_the_load(tmp_path, no_load, args, message) -> None:
    """``ctxc bake --chat`` (issue 35): a model without a chat template, ``--context`` beside
    ``--chat``, a chat file without ``--chat``: one line, before the model loads."""
    model = _no_template_model(tmp_path / "model")
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "system.txt").write_text("Be brief.\n")
    line = _refused(
        ["bake", *args, "--model", str(model), "--out", "out"], tmp_path / "work", no_load
    )
    assert line.startswith(f"ctxc: error: {message}"), line


def _plain_model(folder: Path) -> Path:
    """A model folder with a tokenizer and a config of 256 positions, no weights."""
    from testbed.tiny_models import tiny_tokenizer

    folder.mkdir()
    tiny_tokenizer().save_pretrained(str(folder))
    config = {"model_type": "llama", "max_position_embeddings": 256}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--steps", "5", "--seconds", "3"],
            "--steps is for --method distill (not fit)",
        ),
        (["--from-fit"], "--from-fit is for --method distill (not fit)"),
        (
            ["--data", "continuations", "--samples", "0"],
            "--samples 0 and no --queries: nothing to fit the patch on",
        ),
        (["--queries", "empty.txt"], "query file is empty: empty.txt"),
        (["LONG"], "the context is 300 tokens; the model takes at most 256 positions"),
        (["--route", "LONG", "--chunk-words", "500"], "the context is 300 tokens"),
        (["--method", "additive", "LONG"], "the context is 300 tokens"),
        (["--chunk-words", "50"], "--chunk-words goes with --route"),
        (["--question-prompt", "facts"], "no such option: --question-prompt"),
    ],
    ids=[
        "distill-options-with-fit",
        "from-fit-with-fit",
        "nothing-to-fit",
        "empty-queries",
        "too-long",
        "too-long-routed",
        "too-long-additive",
        "chunk-words-without-route",
        "library-only-setting",
    ],
)
def test_bake_refusals_come_before_the_load(tmp_path, no_load, args, message) -> None:
    """``ctxc bake`` (issue 52): options of another method, nothing to fit on, a context past
    the model's positions, a setting the benchmarks rejected: one line, before the model loads
    (the issue measured 27.9-548 s for these)."""
    model = _plain_model(tmp_path / "model")
    work = tmp_path / "work"
    work.mkdir()
    (work / "c.txt").write_text("w1 w2 w3 w4")
    (work / "long.txt").write_text(" ".join(f"w{i % 90}" for i in range(299)))
    (work / "empty.txt").write_text("\n \n")
    context = ["--context", "long.txt"] if "LONG" in args else ["--context", "c.txt"]
    args = [a for a in args if a != "LONG"]
    argv = ["bake", *context, *args, "--model", str(model), "--out", "out"]
    line = _refused(argv, work, no_load)
    assert message in line, line
