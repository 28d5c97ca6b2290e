"""The suite and the package hold without the optional extras (issue 52): in a venv with
``pip install -e ".[test]"`` alone, a test that needs an extra skips naming it, never fails.

These read the source with ``ast``: no module imports an extra's package at module level (that
would fail the collection, or ``import ctxc``, where the extra is not installed). In the tests an
extra's package is imported inside the test that needs it, marked ``needs_extra``
(tests/fixtures/extras.py, whose table is checked against pyproject here). CI installs every
extra, so this is where a test that forgets fails.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.fixtures.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[2]
# The package's folders (setup.py's package_dir) and what the tests import (tests/, testbed/).
PACKAGE = ("compiler", "passes", "backends")
TESTS = ("tests", "testbed")


def _pyproject_extras() -> dict[str, list[str]]:
    """pyproject's extras: name -> the distribution names it lists."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = data["project"]["optional-dependencies"]
    return {
        name: [re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower() for req in reqs]
        for name, reqs in extras.items()
    }


def _optional_modules(brought_by_test: bool) -> dict[str, str]:
    """Import name -> its extra; less the extras ``[test]`` brings too (Pillow) when
    ``brought_by_test`` (the tests run with ``[test]`` installed, the package without it)."""
    extras = _pyproject_extras()
    test = set(extras.pop("test"))
    return {
        module: name
        for name, modules in EXTRAS.items()
        if not (brought_by_test and set(extras[name]) <= test)
        for module in modules
    }


def _guards_import_error(node: ast.Try) -> bool:
    names = set()
    for handler in node.handlers:
        if handler.type is None:  # a bare except
            return True
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names |= {k.id for k in kinds if isinstance(k, ast.Name)}
    return bool(names & {"ImportError", "ModuleNotFoundError", "Exception"})


def module_level_imports(source: str, optional: dict[str, str]) -> list[str]:
    """``line N: import X ([extra])`` for each import of an extra's package that runs when the
    module is imported: at module level or in a class body, an ``if`` (not ``if TYPE_CHECKING``)
    or a ``try`` that does not catch ImportError; not inside a function."""
    found: list[str] = []

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                visit(node.orelse)
                continue
            elif isinstance(node, ast.Try):
                if not _guards_import_error(node):
                    visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                continue
            elif isinstance(node, (ast.With, ast.ClassDef)):  # a class body runs at import
                visit(node.body)
                continue
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                if root in optional:
                    found.append(f"line {node.lineno}: import {name} ([{optional[root]}])")

    visit(ast.parse(source).body)
    return found


def _scan(folders: tuple[str, ...], optional: dict[str, str]) -> list[str]:
    bad = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for hit in module_level_imports(path.read_text(), optional):
                bad.append(f"{path.relative_to(ROOT)} {hit}")
    return bad


def test_the_extras_table_is_pyprojects() -> None:
    """tests/fixtures/extras.py names every extra pyproject has (less ``test``), and each
    backend's ``requires`` are its extra's import names."""
    from ctxc.backends import BACKENDS

    extras = _pyproject_extras()
    assert set(EXTRAS) == set(extras) - {"test"}, (sorted(EXTRAS), sorted(extras))
    for name, backend in BACKENDS.items():
        if backend.extra is not None:
            assert set(backend.requires) <= set(EXTRAS[backend.extra]), (name, backend.requires)


def test_no_test_imports_an_extra_at_module_level() -> None:
    """A test module (or testbed, which tests import) that imported an extra's package at module
    level would fail the collection where the extra is missing: import it in the tests that
    need it, marked ``needs_extra`` (tests/fixtures/extras.py), or under ``if TYPE_CHECKING``."""
    bad = _scan(TESTS, _optional_modules(brought_by_test=True))
    assert not bad, "\n".join(bad)


def test_the_package_imports_no_extra_at_module_level() -> None:
    """``import ctxc`` and every command's imports hold in a plain install: an extra's package
    is imported where it is needed, after the check that names the extra."""
    bad = _scan(PACKAGE, _optional_modules(brought_by_test=False))
    assert not bad, "\n".join(bad)


def test_the_scan_finds_a_seeded_import() -> None:
    """The scan can fail: each unguarded form is found, each guarded one is not."""
    optional = _optional_modules(brought_by_test=True)
    unguarded = (
        "import onnxruntime as ort\n"
        "from peft import PeftModel\n"
        "import matplotlib.pyplot as plt\n"
        "if True:\n    import ray\n"
        "try:\n    import onnx\nexcept RuntimeError:\n    pass\n"
        "class TestZ:\n    import onnxscript\n"
    )
    found = module_level_imports(unguarded, optional)
    assert [hit.split(":")[0] for hit in found] == [
        "line 1",
        "line 2",
        "line 3",
        "line 5",
        "line 7",
        "line 11",
    ]
    assert "([onnx])" in found[0] and "([peft])" in found[1], found
    guarded = (
        "from typing import TYPE_CHECKING\n"
        "import pytest\n"
        "from PIL import Image\n"  # Pillow comes with [test]
        "if TYPE_CHECKING:\n    import onnxruntime\n"
        "try:\n    import ray\nexcept ImportError:\n    ray = None\n"
        "ort = pytest.importorskip('onnxruntime')\n"
        "def test_x():\n    from peft import PeftModel\n"
        "class TestY:\n    def test_y(self):\n        import matplotlib\n"
    )
    assert module_level_imports(guarded, optional) == []
    package = _optional_modules(brought_by_test=False)
    assert module_level_imports("from PIL import Image\n", package) == [
        "line 1: import PIL ([vision])"
    ]
