"""Package list derived from the three source folders (pyproject holds everything else).

pyproject's ``package-dir`` maps ``ctxc`` onto three folders; setuptools' ``packages.find`` cannot
prefix what it finds, so the packages are listed here from the folders themselves: a new stage or
backend folder (with its ``__init__.py``) is packaged without a line anywhere (issue 37).
"""

from __future__ import annotations

from setuptools import find_packages, setup

# Import name -> source folder; the same mapping as tests/project/test_structure.py's PACKAGES.
ROOTS = {"ctxc": "compiler", "ctxc.passes": "passes", "ctxc.backends": "backends"}

packages = [
    name
    for root, folder in ROOTS.items()
    for name in (root, *(f"{root}.{found}" for found in find_packages(folder)))
]
# HTML templates and data files (ctxc.bake.scope's word list): data folders with no
# __init__.py, shipped through package-data.
packages += ["ctxc.templates", "ctxc.resources"]

setup(package_dir=ROOTS, packages=packages)
