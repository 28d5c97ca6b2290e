"""The documentation holds: a short README, links that resolve, paths and functions that exist.

Torch-free and fast: it reads Markdown and parses Python files with ``ast``, imports nothing of
ctxc. What it guards: the README stays a front door (at most 12 KB, the test command ``.ci/run``
runs), ``docs/architecture.md``'s walkthrough names files and functions that exist, so do
``docs/DESIGN.md`` and ``docs/rules.md`` (each ``path:name``, each ```NAME` in `path``` and
DESIGN.md's data flow, ``name(args) -> Type``, checked against the code), every relative link
lands on a file (and a heading, when it names one), every benchmark named as
``python -m benchmarks.<kind>.<name>`` is a module, every measured table is stamped, and every
repository path or page a docstring of the package names exists.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.tables import MARKER, table, write_table

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PAGES = [README, *DOCS]

# A backticked repository path, optionally with ``:name`` or ``:Class.method``.
_PATH = re.compile(
    r"`((?:compiler|passes|backends|benchmarks|tests|docs|examples)/[\w./-]*|pyproject\.toml)"
    r"(?::([\w.]+))?`"
)
# ```NAME` in `path```: a name a page places in a module.
_IN = re.compile(r"`([A-Za-z_]\w*)` in\s+`((?:compiler|passes|backends)/[\w./-]+\.py)`")
# A line of DESIGN.md's data flow: ``name(args) -> Type`` (the call may fill its own line).
_FLOW = re.compile(r"^ {4}(\w+)\([^)]*\)\s*->\s*([A-Z]\w*)(?= {2}|$)", re.M)
_CODE = ("compiler", "passes", "backends")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_MODULE = re.compile(r"python -m (benchmarks(?:\.\w+)+)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
# A repository path in a docstring, backticked or not: ``docs/bake.md``, compiler/bake/route.py,
# benchmarks/results/bake_cost*.json (a glob); not the tail of another path (vllm/lora/...).
_DOC_PATH = re.compile(
    r"(?<![\w./-])((?:compiler|passes|backends|benchmarks|tests|docs|examples|testbed|tools)/"
    r"[\w./*-]*[\w*/])"
)
# A page a docstring names by itself (MATH.md, block-shapes.md): a page of these folders.
_DOC_PAGE = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
_PAGE_HOMES = ("", "docs", "docs/results")


def _text(page: Path) -> str:
    return _FENCE.sub("", page.read_text())


def _assigned(node: ast.stmt) -> list[str]:
    """The plain names an assignment binds (``NAME = ...``, ``NAME: T = ...``)."""
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _defines(path: Path, dotted: str) -> bool:
    """Whether ``path`` defines ``dotted`` (``f``, ``Class``, ``Class.method`` or a constant) at
    its top."""
    body: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found = [
            n
            for n in body
            if (
                isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and n.name == part
            )
            or part in _assigned(n)
        ]
        if not found:
            return False
        body = found[0].body if isinstance(found[0], ast.ClassDef) else []
    return True


def _wrong_names(page: Path) -> list[str]:
    """The ``path:name`` and ```NAME` in `path``` of ``page`` that the code does not hold."""
    text = page.read_text()
    refs = {(p, n) for p, n in _PATH.findall(text) if n}
    refs |= {(p, n) for n, p in _IN.findall(text)}
    return sorted(
        f"{p}:{n}" for p, n in refs if not (ROOT / p).is_file() or not _defines(ROOT / p, n)
    )


def _returns(name: str) -> set[str]:
    """The return annotations of every top-level function ``name`` of the package."""
    found = set()
    for path in sorted(p for d in _CODE for p in (ROOT / d).rglob("*.py")):
        for n in ast.parse(path.read_text()).body:
            if isinstance(n, ast.FunctionDef) and n.name == name:
                found.add(ast.unparse(n.returns) if n.returns is not None else "")
    return found


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    heads = re.findall(r"^#+\s+(.+?)\s*$", _text(page), re.M)
    return {_slug(h) for h in heads}


def _docstrings(path: Path) -> Iterator[tuple[int, str]]:
    """Each docstring of ``path`` (module, class, function) with the line it starts on."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text is not None:
                yield node.body[0].lineno, text


def _docstring_references() -> list[tuple[str, str, bool]]:
    """``(file:line, path, exists)`` for every repository path and page the package's docstrings
    name."""
    found = []
    for path in sorted(p for d in _CODE for p in (ROOT / d).rglob("*.py")):
        for start, text in _docstrings(path):
            for pattern, exists in (
                (_DOC_PATH, lambda n: any(ROOT.glob(n)) if "*" in n else (ROOT / n).exists()),
                (_DOC_PAGE, lambda n: any((ROOT / home / n).is_file() for home in _PAGE_HOMES)),
            ):
                for m in pattern.finditer(text):
                    where = f"{path.relative_to(ROOT)}:{start + text.count(chr(10), 0, m.start())}"
                    found.append((where, m.group(1), exists(m.group(1))))
    return found


def test_readme_is_a_front_door() -> None:
    size = len(README.read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes, more than 12 KB: move detail to docs/"
    text = README.read_text()
    history = [m.group(0) for m in re.finditer(r"\bissue \d+|not rerun since", text, re.I)]
    assert not history, f"history in the README: {history}"


def test_readme_keeps_the_ci_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.startswith("ruff check"), ci
    assert f"    {ci}\n" in README.read_text(), f"the README lost .ci/run's test command: {ci}"


def test_architecture_names_files_and_functions_that_exist() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    refs = sorted(set(_PATH.findall(text)))
    missing = [p for p, _ in refs if not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    undefined = [f"{p}:{n}" for p, n in refs if n and not _defines(ROOT / p, n)]
    assert not undefined, f"docs/architecture.md names functions that do not exist: {undefined}"
    # The walkthrough names a function at every step: an emptied page must not pass.
    assert sum(1 for _, n in refs if n) >= 30, refs


@pytest.mark.parametrize("name", ["architecture.md", "DESIGN.md", "rules.md"])
def test_design_pages_name_what_the_code_holds(name: str) -> None:
    wrong = _wrong_names(ROOT / "docs" / name)
    assert not wrong, f"docs/{name} names what the code does not hold: {wrong}"


def test_design_data_flow_is_the_code() -> None:
    flow = _FLOW.findall((ROOT / "docs" / "DESIGN.md").read_text())
    assert len(flow) >= 4, flow  # an emptied data flow must not pass
    wrong = [
        f"{f} -> {t} (the code: {sorted(_returns(f))})" for f, t in flow if t not in _returns(f)
    ]
    assert not wrong, f"docs/DESIGN.md's data flow is not the code's: {wrong}"


def test_every_backticked_path_in_the_docs_exists() -> None:
    missing = []
    for page in PAGES:
        for path, _ in _PATH.findall(_text(page)):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_every_path_a_docstring_names_exists() -> None:
    refs = _docstring_references()
    assert sum(ok for *_, ok in refs) >= 100, refs  # the walk sees the docstrings
    missing = [f"{where}: {name}" for where, name, ok in refs if not ok]
    assert not missing, "docstrings name paths that do not exist:\n" + "\n".join(missing)


def test_relative_links_resolve() -> None:
    broken = []
    for page in PAGES:
        for target in _LINK.findall(_text(page)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.is_file():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "links that do not resolve:\n" + "\n".join(broken)


def test_named_benchmarks_are_modules() -> None:
    missing = []
    for page in PAGES:
        for module in _MODULE.findall(page.read_text()):
            path = ROOT.joinpath(*module.split("."))
            if not path.with_suffix(".py").is_file():
                missing.append(f"{page.relative_to(ROOT)}: python -m {module}")
    assert not missing, "benchmarks that are no module:\n" + "\n".join(missing)


def test_every_results_page_is_stamped() -> None:
    pages = [p for p in (ROOT / "docs" / "results").glob("*.md") if p.name != "README.md"]
    assert len(pages) >= 5, pages
    stamps = ("Measured at commit", "Rendered at commit", "Measured for commit", "Carried from")
    unstamped = []
    for page in pages:
        head = "\n".join(page.read_text().splitlines()[:8])
        if not re.search(rf"({'|'.join(stamps)})[^`]*`[0-9a-f]{{7,}}", head):
            unstamped.append(page.name)
    assert not unstamped, f"results pages without a commit stamp: {unstamped}"


def test_write_table_stamps_commit_date_and_command(tmp_path) -> None:
    command = "python -m benchmarks.fidelity.fresh"
    path = write_table(tmp_path / "t.md", "A table", command, ["a", "b"], [[1, "x|y"]])
    text = path.read_text()
    assert text.startswith(f"# A table\n\n{MARKER}\nMeasured at commit `"), text
    assert re.search(r"on \d{4}-\d{2}-\d{2} \(UTC\) by:\n\n    python -m benchmarks", text), text
    assert text.endswith("| a | b |\n|---|---|\n| 1 | x\\|y |\n"), text
    with pytest.raises(ValueError, match="a row has 1 cells, the header 2"):
        table(["a", "b"], [[1]])
