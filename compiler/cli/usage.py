"""Click's usage errors as the one-line messages of the CLI contract (DESIGN.md)."""

from __future__ import annotations

from typing import Protocol, TypeGuard

__all__ = ["hide_flag_types", "is_click", "raw_value", "usage_message"]


def hide_flag_types() -> None:
    """Show flags in ``--help`` as ``--force``, not ``--force <bool>``.

    Typer's help prints every option's value type, flags included (they take no value), and
    ``--help`` itself is built inside typer, out of reach of a ``metavar``: a flag's type column
    is left empty instead, for every command. Side effects: patches typer's option class once.
    """
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich
    if getattr(shown, "ctxc_flags_hidden", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.ctxc_flags_hidden = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]  # the patch


class ClickError(Protocol):
    """What the CLI reads of a click exception (typer's vendored click or click)."""

    def format_message(self) -> str: ...


def is_click(exc: BaseException, name: str) -> TypeGuard[ClickError]:
    # Typer vendors its own click (typer._click), so `except click.ClickException` misses its
    # exceptions; match the class by name through the hierarchy instead, for either click.
    return any(cls.__name__ == name for cls in type(exc).__mro__)


def usage_message(exc, argv: list[str], commands: list[str]) -> str:
    """Click's message as one line that names the option, its value and what it takes.

    Args:
        exc: the click exception (typer's vendored click or click itself).
        argv: the command line, to quote the value given.
        commands: the app's command names, listed for an unknown command.

    Returns:
        the message, without the ``ctxc: error:`` prefix.
    """
    message = " ".join(str(exc.format_message()).split()).rstrip(".")
    head, sep, detail = message.partition("': ")
    if message.startswith("Invalid value for") and sep:
        # Typer validates through pydantic: drop its prefix, and say what the value was.
        detail = detail.removeprefix("Value error, ")
        opts = getattr(getattr(exc, "param", None), "opts", None) or []
        raw = raw_value(argv, opts)
        if detail.startswith("Input should be a valid integer") and raw is not None:
            detail = f"{raw!r} is not an integer"
        elif detail.startswith("Input should be") and raw is not None:
            detail = f"{raw!r}: {detail[:1].lower()}{detail[1:]}"
        message = f"{head}{sep}{detail}"
    elif message.startswith("Got unexpected extra argument"):
        extra = message[message.rfind("(") + 1 :].rstrip(")")
        message = f"unexpected argument {extra!r} (flags such as --force take no value)"
    elif message.startswith("No such command"):
        message = f"{message}; commands: {', '.join(commands)}"
    return message[:1].lower() + message[1:]


def raw_value(argv: list[str], opts: list[str]) -> str | None:
    """The value given to one of ``opts`` on the command line (``--x v`` or ``--x=v``)."""
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in opts:
            if eq:
                return value
            if i + 1 < len(argv):
                return argv[i + 1]
    return None
