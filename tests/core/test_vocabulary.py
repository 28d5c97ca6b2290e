"""One place per decision (issue 22): the vocabulary of choices and the errors naming parameters.

No model is built: these import the torch-free vocabulary, the backend registry and the CLI.
"""

from __future__ import annotations

import pytest

from ctxc.core.errors import CtxcError, OptionError
from ctxc.core.vocabulary import (
    BAKE_METHODS,
    DTYPES,
    EXACT_RULES,
    FORMATS,
    GGUF_TYPES,
    LORA_RULE,
    RULES,
    check_choice,
)


def test_rules_are_the_exact_ones_and_lora() -> None:
    assert (*EXACT_RULES, LORA_RULE) == RULES


def test_the_older_names_are_the_vocabulary() -> None:
    # Modules that named the rules and types before keep the names, bound to the vocabulary.
    from ctxc.backends.gguf.model import GGUF_TYPES as gguf_types
    from ctxc.core.checks import EXACT_RULES as exact
    from ctxc.passes.locate.plan import RULES as plan_rules
    from ctxc.passes.solver.solve import RULES as solve_rules

    assert plan_rules is RULES and solve_rules is RULES and exact is EXACT_RULES
    assert gguf_types is GGUF_TYPES


@pytest.mark.parametrize(
    ("param", "value", "choices", "what", "message"),
    [
        (
            "update",
            "fancy",
            RULES,
            "update rule",
            "update: unknown update rule 'fancy'; expected one of standard, stable, output, lora",
        ),
        (
            "dtype",
            "f{8}",
            DTYPES,
            "dtype",
            "dtype: unknown dtype 'f{8}'; expected one of float32, bfloat16, float16",
        ),
    ],
)
def test_check_choice_names_the_parameter(param, value, choices, what, message) -> None:
    assert check_choice(param, choices and next(iter(choices)), choices, what)
    with pytest.raises(OptionError) as caught:
        check_choice(param, value, choices, what)
    assert str(caught.value) == message
    assert isinstance(caught.value, CtxcError) and caught.value.params == (param,)


def test_an_option_error_renders_with_flags() -> None:
    exc = OptionError("{samples} {} and no {queries}: nothing to fit on {!r}", 0, "a{b}")
    assert str(exc) == "samples 0 and no queries: nothing to fit on 'a{b}'"
    flagged = exc.render(lambda p: "--" + p.replace("_", "-"))
    assert flagged == "--samples 0 and no --queries: nothing to fit on 'a{b}'"


@pytest.mark.parametrize(
    ("command", "flag", "choices"),
    [
        ("compile", "--update", RULES),
        ("generate", "--update", RULES),
        ("compile", "--dtype", DTYPES),
        ("compile", "--gguf-type", GGUF_TYPES),
        ("export", "--gguf-type", GGUF_TYPES),
        ("inspect", "--format", FORMATS),
        ("bake", "--method", BAKE_METHODS),
    ],
)
def test_cli_choices_come_from_the_vocabulary(command, flag, choices, capsys) -> None:
    from ctxc.cli.app import main

    assert main([command, flag, "x"]) == 2
    listed = ", ".join(repr(c) for c in choices)
    want = f"ctxc: error: invalid value for '{flag}': 'x' is not one of {listed}"
    assert capsys.readouterr().err.splitlines() == [want]


def test_cli_emit_names_come_from_the_registry(capsys) -> None:
    from ctxc.backends import BACKENDS
    from ctxc.cli.app import main

    assert main(["compile", "--context", "c.txt", "--emit", "x"]) == 2
    want = f"invalid value for '--emit': 'x'; expected a comma list of {', '.join(BACKENDS)}"
    assert capsys.readouterr().err.splitlines() == [f"ctxc: error: {want}"]
