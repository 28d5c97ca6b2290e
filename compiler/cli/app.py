"""The ``ctxc`` command line (DESIGN.md, CLI contract).

Exit codes: 0 success (``ctxc`` alone prints the help, as ``--help`` does: asking for help is
no error); 2 a usage error or any other error a user can cause, printed as one line
``ctxc: error: ...``; 1 an internal error (a bug: one line, ``CTXC_DEBUG=1`` for the
traceback); 130 after Ctrl-C and 143 after SIGTERM (128 + the signal, as shells report it),
printed as ``ctxc: interrupted``. No error leaves a partly written output folder.

This module holds the typer app, ``main`` and the translation of click's usage errors into
those lines; each command lives in a module of its own (``compile.py``, ``export.py``,
``inspect.py``, ``generate.py``, ``bake.py``: bake and eval-bake), the options they share in
``options.py``. ``python -m ctxc.cli.app`` and the ``ctxc`` script both run :func:`run`:
:func:`main`, then a prompt exit.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Protocol, TypeGuard

import typer

from ctxc._version import __version__
from ctxc.cli.bake import bake_cmd, eval_bake_cmd
from ctxc.cli.compile import compile_cmd
from ctxc.cli.export import export_cmd
from ctxc.cli.generate import generate_cmd
from ctxc.cli.inspect import inspect_cmd
from ctxc.cli.options import cli_message
from ctxc.cli.progress import VERBOSE, command_trail, err, finish, quiet_defaults, say, stage
from ctxc.cli.route import route_cmd
from ctxc.core.errors import CtxcError, environment_error, missing_package_error
from ctxc.core.interrupts import install_handlers, interrupt_note, received
from ctxc.core.threads import choose_threads

__all__ = [
    "app",
    "command_names",
    "hide_flag_types",
    "is_click",
    "main",
    "raw_value",
    "run",
    "usage_message",
]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Compile a context into exact low-rank patches of a transformer's MLP weights.",
)
# One module per command (compiler/cli/<command>.py), registered in the order --help lists them.
app.command("bake")(bake_cmd)  # thought patches (issue 13)
app.command("eval-bake")(eval_bake_cmd)
app.command("route")(route_cmd)  # a routed bake's chunk for a question (issue 36)
app.command("compile")(compile_cmd)
app.command("export")(export_cmd)
app.command("inspect")(inspect_cmd)
app.command("generate")(generate_cmd)


def _version(value: bool) -> None:
    if value:
        say(f"ctxc {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
    verbose: bool = VERBOSE,
    threads: int = typer.Option(
        None,
        "--threads",
        min=1,
        envvar="CTXC_THREADS",
        help="torch's CPU threads for the command (default: torch's, one a core). Beside "
        "another busy job, 1 is faster: two threads wait on each other (docs/results/speed.md).",
    ),
) -> None:
    """Compile a context into exact low-rank patches of a transformer's MLP weights."""
    if threads is not None:
        # Imported here: ``ctxc --help`` stays free of torch (tests/cli/test_cli_usage.py).
        import torch

        torch.set_num_threads(threads)
        return
    # Beside other jobs, threads spinning for a held core burn the CPU they wait on: torch gets
    # the free cores (before it loads; a quiet machine is left as it is; issue 55).
    asked_help = any(a in ("--help", "-h") for a in sys.argv[1:])
    chosen = None if asked_help else choose_threads()
    if chosen is not None:
        stage(f"other jobs hold cores: {chosen} torch thread(s) (--threads N to choose)", True)


def main(argv: list[str] | None = None) -> int:
    """Console entry point: runs the app; every error becomes one line and an exit code.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        the exit status (see the module docstring).
    """
    quiet_defaults()  # third-party warnings and bars off; -v/--verbose turns them back on
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    restore = install_handlers()
    try:
        return _run(argv)
    finally:
        restore()


def run() -> None:
    """The ``ctxc`` command: :func:`main`, then the process ends without the interpreter's
    teardown.

    Every file a command writes is closed and renamed into place before :func:`main` returns;
    what is left is freeing what the process holds, object by object: after a compile of the
    bundled model (a graph and a model: 420k objects, 2.7 GB) that took 1.4 s of a 13 s process
    on the 2-core machine of docs/results/speed.md, more than the solve. The exit handlers
    still run (logging, Ray, temporary folders), the streams are flushed, then ``os._exit``.
    Library callers and tests call :func:`main`, which returns.
    """
    code = main()
    atexit._run_exitfuncs()  # what the interpreter runs at exit, before its teardown
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            code = code or 1
    os._exit(code)


def _run(argv: list[str] | None) -> int:
    try:
        with command_trail():  # the progress display ends before any error line is printed
            rc = app(args=argv, standalone_mode=False, prog_name="ctxc")
            finish(ok=not rc)  # typer returns 130 after Ctrl-C: no "done" then
    except KeyboardInterrupt:
        rc = 130
    except CtxcError as exc:
        return _error(cli_message(exc))
    except Exception as exc:
        missing = missing_package_error(exc, "this run")  # torchvision, timm, Pillow
        if missing is not None:
            return _error(str(missing))
        refused = environment_error(exc)  # disk full, read-only, permissions: not a bug
        if refused is not None:
            return _error(str(refused))
        if is_click(exc, "NoArgsIsHelpError"):  # `ctxc` alone: the help, like --help
            say(exc.format_message())
            return 0
        if is_click(exc, "ClickException"):
            return _error(
                usage_message(exc, sys.argv[1:] if argv is None else argv, command_names())
            )
        if os.environ.get("CTXC_DEBUG"):
            raise
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = lines[0] if lines else ""
        err.print(
            f"ctxc: internal error: {type(exc).__name__}: {first} (set CTXC_DEBUG=1 for details)",
            highlight=False,
            soft_wrap=True,
            markup=False,
        )
        return 1
    if rc == 130:  # typer turns KeyboardInterrupt into Exit(130) and returns the code
        note = interrupt_note()  # a batch's finished lines: where, and how to go on
        line = f"ctxc: interrupted{'; ' + note if note else ''}"
        err.print(line, highlight=False, soft_wrap=True, markup=False)  # one line, any width
        return 128 + received()
    return int(rc or 0) if isinstance(rc, int) else 0


def command_names() -> list[str]:
    """The names of the app's commands, sorted."""
    return sorted(cmd.name or "" for cmd in app.registered_commands)


def _error(message: str) -> int:
    err.print(f"ctxc: error: {message}", highlight=False, soft_wrap=True, markup=False)
    return 2


# Click's usage errors as the one-line messages of the CLI contract (DESIGN.md).


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
    """Whether ``exc`` is click's exception class ``name`` (or derives from it)."""
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


hide_flag_types()  # --force, not --force <bool>, in --help


if __name__ == "__main__":
    run()
