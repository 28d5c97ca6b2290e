"""Every fidelity bound in a torch-free module named ``thresholds.py`` (issue 21): the shared
ones in ``compiler/core/thresholds.py``, each backend's beside it (``backends/<format>/``), the
reload bound two formats share in ``backends/thresholds.py``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ctxc.backends.onnx.thresholds import ONNX_ATOL, ONNX_FLOOR_FACTOR
from ctxc.backends.thresholds import RELOAD_ATOL, reload_bound
from ctxc.core.thresholds import EXACT_ATOL, floor_bound

ROOT = Path(__file__).resolve().parents[2]
# A public module-level numeric bound: NAME_ATOL = 1e-3, NAME_RTOL = ..., NAME_TOL = ... (a
# private one, ``_TOL``, is a solver's convergence tolerance, not a fidelity bound).
_BOUND = re.compile(r"^[A-Z][A-Z_]*(?:ATOL|RTOL|TOL)\s*=\s*[0-9.]+(?:e-?[0-9]+)?\s*(?:#.*)?$", re.M)
# Source folder -> import name (setup.py's mapping).
_PACKAGES = {"compiler": "ctxc", "passes": "ctxc.passes", "backends": "ctxc.backends"}
MODULES = sorted(
    _PACKAGES[path.relative_to(ROOT).parts[0]]
    + "".join(f".{part}" for part in path.relative_to(ROOT).with_suffix("").parts[1:])
    for folder in _PACKAGES
    for path in (ROOT / folder).rglob("thresholds.py")
)


def test_the_bounds_modules_are_found() -> None:
    assert "ctxc.core.thresholds" in MODULES and "ctxc.backends.onnx.thresholds" in MODULES, MODULES


@pytest.mark.parametrize("module", MODULES)
def test_the_module_imports_without_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


@pytest.mark.parametrize("folder", ["backends", "compiler", "passes"])
def test_no_other_module_sets_a_bound_of_its_own(folder):
    found = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name != "thresholds.py"
        for m in _BOUND.finditer(path.read_text())
    ]
    assert not found, found


def test_floor_bound_is_the_larger_of_the_absolute_and_the_floor_multiple():
    assert floor_bound(ONNX_ATOL, None, ONNX_FLOOR_FACTOR) == ONNX_ATOL
    assert floor_bound(ONNX_ATOL, float("nan"), ONNX_FLOOR_FACTOR) == ONNX_ATOL
    assert floor_bound(ONNX_ATOL, 1e-5, ONNX_FLOOR_FACTOR) == ONNX_ATOL
    assert floor_bound(ONNX_ATOL, 1e-3, ONNX_FLOOR_FACTOR) == pytest.approx(4e-3)


def test_reload_bound_by_dtype():
    assert reload_bound("float32", 30.0) == RELOAD_ATOL >= EXACT_ATOL
    # bfloat16: four spacings at the largest logit (2^-7 * 30 * 4 ~ 0.94); float16 finer
    assert reload_bound("bfloat16", 30.0) == pytest.approx(4 * 2.0**-7 * 30.0)
    assert reload_bound("float16", 30.0) == pytest.approx(4 * 2.0**-10 * 30.0)
    assert reload_bound("bfloat16", 0.0) >= RELOAD_ATOL
