"""The package as pip builds it (issue 20.5): no packaging warnings, its data, its import.

A wheel is built from a copy of the sources (offline, no build isolation: the test venv's
setuptools) and unpacked into a folder put on ``PYTHONPATH``, so nothing is installed here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "compiler", "passes", "backends")
# Import name -> source folder, as setup.py maps them.
FOLDERS = {"ctxc": "compiler", "ctxc.passes": "passes", "ctxc.backends": "backends"}


def _wheel(tmp_path: Path) -> tuple[Path, str]:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-index", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(
        [*pip, "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("ctxc-*.whl")
    return wheel, proc.stdout + proc.stderr


def test_wheel_builds_without_warnings_holds_its_data_and_wins_over_a_clone(tmp_path) -> None:
    wheel, log = _wheel(tmp_path)
    # The license table and ctxc.templates absent from `packages` each warned on every install.
    assert "Warning" not in log and "deprecated" not in log, log
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {"ctxc/templates/inspect.html", "ctxc/py.typed", "ctxc/passes/solver/solve.py"}
    assert shipped | {"ctxc/resources/wordfreq_en.tsv.gz"} <= set(names), names
    # setup.py lists the packages from the folders (issue 37): every package folder is shipped,
    # a new backend or stage without a line in pyproject.
    for package, folder in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.relative_to(ROOT / folder).as_posix()
            shipped = f"{package.replace('.', '/')}/{rel}"
            assert shipped in names, f"{shipped} not in the wheel"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # Python run from the folder above a clone named ctxc: the clone (no __init__.py at its root)
    # is a namespace portion, which a regular package later on sys.path takes precedence over.
    parent = tmp_path / "parent"
    (parent / "ctxc").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = (
        "import ctxc; from importlib import resources; print(ctxc.__file__); "
        "print(len(resources.files('ctxc').joinpath('templates', 'inspect.html').read_text())); "
        "from ctxc.bake.scope import rarity; print(rarity('the'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=parent, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == str(site / "ctxc" / "__init__.py"), proc.stdout
    assert proc.stdout.splitlines()[2] == "127", proc.stdout  # the word list read from the wheel
