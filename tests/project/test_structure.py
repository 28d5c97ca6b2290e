"""The package's shape (issue 8): layering, file and function sizes, no private imports.

These read the source with ``ast``; they import nothing from ctxc, so they run in milliseconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Import name -> source folder, as pyproject's package-dir maps them.
PACKAGES = {
    "ctxc.passes": ROOT / "passes",
    "ctxc.backends": ROOT / "backends",
    "ctxc": ROOT / "compiler",
}
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def _sources() -> list[tuple[str, Path]]:
    """(dotted module name, path) for every module of the package."""
    found = []
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found.append((".".join([package, *parts]), path))
    return found


def _imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every import statement, lazy ones inside functions too."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [alias.name for alias in node.names]))
    return out


SOURCES = _sources()


def _layer(module: str) -> str:
    if module.startswith("ctxc.passes"):
        return "passes"
    if module.startswith("ctxc.backends"):
        return "backends"
    return "compiler"


@pytest.mark.parametrize(("module", "path"), SOURCES, ids=[m for m, _ in SOURCES])
def test_layering(module: str, path: Path) -> None:
    """passes never import backends or the driver; backends never import the CLI or pipeline."""
    forbidden = {
        "passes": ("ctxc.backends", "ctxc.cli.app", "ctxc.pipeline"),
        "backends": ("ctxc.cli.app", "ctxc.pipeline"),
        "compiler": (),
    }[_layer(module)]
    bad = [
        name
        for name, _ in _imports(ast.parse(path.read_text()))
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    assert not bad, f"{module} imports {bad}, across its layer"


@pytest.mark.parametrize(("module", "path"), SOURCES, ids=[m for m, _ in SOURCES])
def test_no_private_imports(module: str, path: Path) -> None:
    """No underscore name is imported from another module of the package."""
    bad = [
        f"{name}.{item}"
        for name, items in _imports(ast.parse(path.read_text()))
        if name.startswith("ctxc")
        for item in items
        if item.startswith("_") and not item.startswith("__")
    ]
    assert not bad, f"{module} imports private names {bad}"


@pytest.mark.parametrize(("module", "path"), SOURCES, ids=[m for m, _ in SOURCES])
def test_sizes(module: str, path: Path) -> None:
    """No file over 600 lines, no function over 80."""
    text = path.read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_FILE_LINES, f"{module}: {lines} lines (at most {MAX_FILE_LINES})"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{module}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_sources_found() -> None:
    """The walk above sees the package (a test over no files would pass vacuously)."""
    names = {m for m, _ in SOURCES}
    assert {"ctxc.cli.app", "ctxc.passes.solver.solve", "ctxc.backends.onnx.model"} <= names, (
        sorted(names)
    )
