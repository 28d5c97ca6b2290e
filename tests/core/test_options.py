"""The library's options (issue 22): validated once, when made; errors name the library's own
parameters, and the CLI prints the flag that sets each (``compiler/cli/options.py``: FLAGS).

No model is built, except the last test's tiny one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ctxc.cli.options import FLAGS, cli_message
from ctxc.core.errors import CtxcError, OptionError
from ctxc.core.options import BakeOptions, CompileOptions, GenerateOptions

ROOT = Path(__file__).resolve().parents[2]

CASES = [
    (lambda: CompileOptions(update="fancy"), "update: unknown update rule 'fancy'", "--update: "),
    (lambda: CompileOptions(start_layer=-1), "start_layer must be at least 0 (got -1)", None),
    (lambda: CompileOptions(apply="eager"), "apply: unknown apply mode 'eager'", None),
    (lambda: GenerateOptions(0), "max_new_tokens must be at least 1", None),
    (lambda: BakeOptions(rank=0), "rank must be at least 1 (got 0)", None),
    (lambda: BakeOptions(samples=-1), "samples must be at least 0 (got -1)", None),
    (lambda: BakeOptions(sample_tokens=0), "sample_tokens must be at least 1 (got 0)", None),
    (lambda: BakeOptions(distill_steps=0), "distill_steps must be at least 1 (got 0)", None),
    (lambda: BakeOptions(distill_seconds=0.0), "distill_seconds must be positive (got 0.0)", None),
    (
        lambda: BakeOptions(samples=0, data="continuations").check_fit(None),
        "samples 0 and no queries: nothing",
        None,
    ),
    (
        lambda: BakeOptions(samples=0, questions=0, cloze=0, data="both").check_fit(None),
        "samples 0 and questions 0 and cloze 0 and no queries: nothing",
        None,
    ),
    (
        lambda: BakeOptions(questions=0, cloze=0, data="self-study").check_fit([]),
        "questions 0 and",
        None,
    ),
    (lambda: BakeOptions(data="none"), "data: unknown fit data kind 'none'", None),
    (lambda: BakeOptions(answer_tokens=0), "answer_tokens must be at least 1 (got 0)", None),
    (lambda: BakeOptions(topics=-1), "topics must be at least 0 (got -1)", None),
    (lambda: BakeOptions(cloze=-1), "cloze must be at least 0 (got -1)", None),
    (lambda: BakeOptions(question_prompt="x"), "question_prompt: unknown question prompt", None),
    (
        lambda: BakeOptions(question_temperature=0.0),
        "question_temperature must be positive (got 0.0)",
        None,
    ),
    (
        lambda: BakeOptions(questions=0, topics=0, cloze=0, data="self-study").check_fit(None),
        "questions 0 and cloze 0 and no queries",
        None,
    ),
]


@pytest.mark.parametrize(("make", "message", "_"), CASES, ids=[c[1][:30] for c in CASES])
def test_a_bad_option_names_the_library_parameter(make, message, _) -> None:
    with pytest.raises(OptionError) as caught:
        make()
    assert str(caught.value).startswith(message), str(caught.value)
    shown = cli_message(caught.value)
    for param in caught.value.params:  # the CLI names the flag instead (when it has one)
        assert FLAGS.get(param, param) in shown, shown
    assert shown.startswith(FLAGS.get(caught.value.params[0], caught.value.params[0])), shown


def test_the_cli_prints_flags() -> None:
    with pytest.raises(OptionError) as caught:
        BakeOptions(samples=0, data="continuations").check_fit([])
    assert cli_message(caught.value) == "--samples 0 and no --queries: nothing to fit the patch on"
    with pytest.raises(OptionError) as caught:
        GenerateOptions(0)
    assert cli_message(caught.value) == "--max-new-tokens must be at least 1"


def test_options_are_frozen() -> None:
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        CompileOptions().update = "standard"  # type: ignore[misc]


def _messages(path: Path) -> list[str]:
    """Every string constant of a module but its docstrings (f-string parts too) and the flag
    declarations of ``BakeOptions``' fields (``_option(default, group, flag, help)``: the one
    place a bake option's flag and help text are written, read by the CLI)."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    docs |= {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_option"
        for arg in ast.walk(node)
    }
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def test_library_errors_name_no_cli_flag() -> None:
    """No module of the library but the CLI's names a flag of FLAGS in a message: errors name
    the library's parameters, the CLI maps them (the backends still say --update and --emit in
    two hints their tests pin)."""
    flags = re.compile("|".join(rf"(?<![\w-]){re.escape(f)}(?![\w-])" for f in FLAGS.values()))
    bad = [
        (str(path.relative_to(ROOT)), text[:80])
        for folder in (ROOT / "compiler", ROOT / "passes")
        for path in sorted(folder.rglob("*.py"))
        if "cli" not in path.relative_to(ROOT).parts
        for text in _messages(path)
        if flags.search(text)
    ]
    assert not bad, bad


@pytest.mark.tiny
def test_compile_takes_options_or_keywords_not_both() -> None:
    import ctxc
    from testbed.tiny_models import shared

    model = shared("llama")
    with pytest.raises(CtxcError, match="not both"):
        ctxc.compile(model, context_ids=[1, 2, 3], update="standard", options=CompileOptions())
