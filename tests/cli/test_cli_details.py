"""Smaller things a user trips on (issue 20.5): help, flags, queries, names and paths written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ctxc.batch.lines import _parse
from ctxc.core.tokens import split_tokens
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import run_cli

pytestmark = pytest.mark.tiny


def test_help_shows_flags_without_a_value_type() -> None:
    run = run_cli("compile", "--help")
    assert run.returncode == 0, run.stderr
    assert "<bool>" not in run.stdout, run.stdout
    for flag in ("--force", "--skip-unpatchable", "--verbose", "--help"):
        assert flag in run.stdout, flag
    assert "<path>" in run.stdout and "list[Path]" not in run.stdout  # --image


def test_contexts_given_a_folder_says_it_is_a_folder(tmp_path) -> None:
    run = run_cli("compile", "--contexts", str(tmp_path), "--out", str(tmp_path / "o"))
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        f"ctxc: error: --contexts takes a JSON Lines file; {tmp_path} is a folder"
    ]


@pytest.mark.parametrize("emit", ["onnx,,peft", "torch,", ",torch"])
def test_emit_with_an_empty_item_is_refused(emit, tmp_path) -> None:
    (tmp_path / "c.txt").write_text("w1 w2 w3")
    run = run_cli("compile", "--context", "c.txt", "--emit", emit, "--out", "o", cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.splitlines() == [
        f"ctxc: error: invalid value for '--emit': {emit!r} has an empty item; expected a comma "
        "list of torch, onnx, ort-adapter, peft, lora, gguf, gguf-lora, safetensors-delta"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


class _SpaceTokenizer:
    """A tokenizer that, like Gemma's, has tokens for a space and a newline."""

    def __call__(self, text: str, add_special_tokens: bool = True):
        ids = [{" ": 5, "\n": 6}.get(ch, 7) for ch in text]
        return type("Enc", (), {"input_ids": ([1] if add_special_tokens else []) + ids})()


@pytest.mark.parametrize(("query", "ids"), [(" ", [5]), ("\n", [6]), (" \n", [5, 6])])
def test_whitespace_query_is_a_query(query, ids) -> None:
    assert split_tokens(_SpaceTokenizer(), "abc", query) == ([1, 7, 7, 7], ids)
    entry, problem = _parse(json.dumps({"context": "w1", "query": query}), 1, 4)
    assert problem is None and entry["query"] == query, problem


def test_only_the_empty_query_is_refused_as_empty(tiny_model_dir, tmp_path) -> None:
    (tmp_path / "c.txt").write_text("w1 w2 w3")
    args = ["compile", "--model", str(tiny_model_dir), "--context", "c.txt", "--out", "o"]
    empty = run_cli(*args, "--query", "", cwd=tmp_path)
    assert empty.stderr.splitlines() == ["ctxc: error: the query is empty"], empty.stderr
    # The tiny word-level tokenizer has no token for a space: the tokenizer, not the CLI, says so.
    space = run_cli(*args, "--query", " ", cwd=tmp_path)
    assert space.stderr.splitlines() == ["ctxc: error: the query tokenizes to no tokens"]
    assert _parse(json.dumps({"context": "w1", "query": ""}), 1, 4)[0] is None


@needs_extra("peft")
def test_peft_adapter_names_the_base_model_and_has_a_model_card(tiny_model_dir, tmp_path):
    """compile, then export --to peft from relative paths: the names written are absolute."""
    (tmp_path / "c.txt").write_text("w1 w2 w3 w4 w5 w6 w7 w8")
    rel = os.path.relpath(tiny_model_dir, tmp_path)
    run = run_cli("compile", "--model", rel, "--context", "c.txt", "--out", "out", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    run = run_cli(
        *("export", "--patch", "out", "--model", rel, "--to", "peft", "--out", "exp"),
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    base = str(Path(tiny_model_dir).resolve())
    report = json.loads((tmp_path / "exp" / "report.json").read_text())
    assert report["patch"] == str(tmp_path / "out"), report["patch"]
    assert report["model"] == base
    config = json.loads((tmp_path / "exp" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == base, config["base_model_name_or_path"]
    card = (tmp_path / "exp" / "adapter" / "README.md").read_text()
    assert "More Information Needed" not in card
    assert f"**Base model**: `{base}`" in card and f'ctxc.load_model("{base}")' in card
    compiled = json.loads((tmp_path / "out" / "report.json").read_text())
    assert f"**Context**: {len(compiled['context_ids'])} tokens" in card, card
    assert "**Holds**: 9 LoRA pairs (r=1) and 3 modules stored whole" in card, card
    assert "exact low-rank patches" in card and "**fitted**" not in card, card  # a compile's
    merged = report["peft"]["vs_full_context"]["merged"]["max_abs_logit_diff"]
    assert f"| {merged:.3g} |" in card, card
    bound = report["peft"]["vs_full_context"]["bound"]
    assert bound is not None and merged <= bound, report["peft"]["vs_full_context"]
    # The folder is what plain PEFT loads offline, in the card's one line (no gguf_file).
    assert 'model = peft.AutoPeftModelForCausalLM.from_pretrained("PATH/TO/adapter")' in card


def test_inspect_lists_the_lora_rule(tiny_model_dir) -> None:
    run = run_cli("inspect", "--model", str(tiny_model_dir))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    # tiny Gemma 3, 3 blocks: gate, up, down and (behind its post norm) o_proj each
    assert "lora 12" in lines[0], lines[0]
    rules = [line.split()[0] for line in lines if line.startswith("    ") and " patches " in line]
    assert rules[:4] == ["standard", "stable", "output", "lora"], rules
