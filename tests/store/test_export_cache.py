"""The export cache (issue 11): reused across processes, rebuilt when stale, corrupt or foreign.

A new model object built from the same seed stands in for a new process: the in-memory trace
cache is keyed by the model object, so only the disk entry can save it the export.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ctxc
from ctxc.store import export_cache
from ctxc.store.export_cache import StoredProgram, enable, entry_key, entry_path
from ctxc.store.traced import traced_blocks
from testbed.tiny_models import build_any as build
from testbed.tiny_models import tiny_tokenizer
from tests.fixtures.helpers import diff_msg, full_logits, logits, max_diff, random_ids

pytestmark = pytest.mark.tiny

CONTEXT = random_ids(11, 12)
QUERY = random_ids(12, 2)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CTXC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def exports(monkeypatch) -> list[int]:
    """Counts fresh exports (calls of the ladder) made by the export cache."""
    calls: list[int] = []
    real = export_cache.build_frontend

    def counted(model, locate):
        calls.append(1)
        return real(model, locate)

    monkeypatch.setattr(export_cache, "build_frontend", counted)
    return calls


def _compile(family: str = "gpt2", seed: int = 0):
    """(model, result) of a compile on a fresh, cache-enabled model object."""
    model = build(family, seed)
    enable(model)
    return model, ctxc.compile(model, context_ids=CONTEXT, query_ids=QUERY)


def _check_exact(model, result) -> None:
    """The patched model on the query alone gives the full-context logits (control beside)."""
    want = full_logits(model, result.patch)
    got = logits(model, QUERY, result.patch)
    control = logits(model, QUERY)
    assert max_diff(got, want) < 1e-4, diff_msg("patched vs full", got, want)
    assert max_diff(control, want) > 1e-2, diff_msg("control vs full (too close)", control, want)


def _bytes(result, path: Path) -> bytes:
    result.patch.save(path)
    return path.read_bytes()


def _entry(model) -> Path:
    return entry_path(entry_key(model))


# JetMoE: split sizes read from the router at run time (unbacked sizes) in the stored graph.
@pytest.mark.parametrize("family", ["gpt2", "jetmoe"])
def test_second_compile_reuses_the_entry(cache, exports, tmp_path, family: str) -> None:
    first_model, first = _compile(family)
    assert len(exports) == 1 and _entry(first_model).is_file()
    model, again = _compile(family)
    assert len(exports) == 1, "the second compile exported again"
    traced = traced_blocks(model)[0]
    assert isinstance(traced.program, StoredProgram)
    assert _bytes(first, tmp_path / "a.safetensors") == _bytes(again, tmp_path / "b.safetensors")
    assert first.report.emitted == again.report.emitted
    assert first.report.control == again.report.control
    _check_exact(model, again)


def test_truncated_entry_is_rebuilt(cache, exports, tmp_path) -> None:
    model, first = _compile()
    entry = _entry(model)
    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) // 2])
    model, again = _compile()
    assert len(exports) == 2, "a truncated entry was trusted"
    _compile()
    assert len(exports) == 2, "the rebuilt entry was not reused"
    assert _bytes(first, tmp_path / "a.safetensors") == _bytes(again, tmp_path / "b.safetensors")
    _check_exact(model, again)


def test_edited_entry_is_rebuilt(cache, exports) -> None:
    model, _ = _compile()
    entry = _entry(model)
    data = bytearray(entry.read_bytes())
    at = data.index(b"call_function")  # a node's op, in the header: it stays valid JSON
    data[at : at + 13] = b"call_functiom"
    entry.write_bytes(bytes(data))
    model, again = _compile()
    assert len(exports) == 2, "an edited entry was trusted"
    _check_exact(model, again)


def test_other_models_entry_is_rebuilt(cache, exports) -> None:
    other, _ = _compile("opt")
    model, _ = _compile()
    assert len(exports) == 2
    shutil.copyfile(_entry(other), _entry(model))
    model, again = _compile()
    assert len(exports) == 3, "another model's entry was trusted"
    traced = traced_blocks(model)[0]
    assert not isinstance(traced.program, StoredProgram)
    _check_exact(model, again)


def test_version_change_rebuilds(cache, exports, monkeypatch) -> None:
    model, _ = _compile()
    old = _entry(model)
    monkeypatch.setattr(export_cache, "__version__", "999.0")
    model, again = _compile()
    assert len(exports) == 2, "an entry of another ctxc version was reused"
    assert _entry(model) != old and _entry(model).is_file()
    _check_exact(model, again)


def test_a_changed_locator_in_a_subfolder_changes_the_key(monkeypatch, tmp_path) -> None:
    """The key covers every pass, ``passes/locate/`` and ``passes/solver/`` included (after
    the move into subfolders a changed locator reused entries made by the old one)."""
    import ctxc.passes.locate.locate_blocks as located

    monkeypatch.setattr(export_cache, "_SOURCE", [])
    before = export_cache._source_digest()
    source = Path(located.__file__)
    copy = tmp_path / "passes"
    shutil.copytree(source.parents[1], copy)
    (copy / "locate" / "locate_blocks.py").write_text(source.read_text() + "\n# changed\n")
    import ctxc.passes

    monkeypatch.setattr(ctxc.passes, "__file__", str(copy / "__init__.py"))
    monkeypatch.setattr(export_cache, "_SOURCE", [])
    assert export_cache._source_digest() != before


def test_cache_off_and_not_enabled(cache, exports, monkeypatch) -> None:
    model = build("gpt2")  # not enabled: the Python API keeps the ExportedProgram
    ctxc.compile(model, context_ids=CONTEXT, query_ids=QUERY)
    assert not (cache / "exports").exists()
    monkeypatch.setenv("CTXC_EXPORT_CACHE", "0")
    _compile()
    assert not (cache / "exports").exists()


def test_two_processes_at_once_from_an_empty_cache(tmp_path) -> None:
    """Two ``ctxc compile`` processes start together on an empty cache: both succeed, agree
    bit for bit, and leave one valid entry (no partial file)."""
    model_dir = tmp_path / "gpt2"
    build("gpt2").save_pretrained(str(model_dir))  # exports in ~2 s, where Gemma 3 takes ~7
    tiny_tokenizer().save_pretrained(str(model_dir))
    (tmp_path / "c.txt").write_text("w5 w6 w7 w8 w9 w10 w11")
    env = {**os.environ, "CTXC_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "ctxc.cli.app", "compile", "--context", str(tmp_path / "c.txt")]
    cli += ["--model", str(model_dir)]
    procs = [
        subprocess.Popen(
            [*cli, "--out", str(tmp_path / f"out{i}")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-2000:]
    a, b = (tmp_path / f"out{i}" for i in range(2))
    assert (a / "patch.safetensors").read_bytes() == (b / "patch.safetensors").read_bytes()
    ra, rb = (json.loads((d / "report.json").read_text()) for d in (a, b))
    assert ra["max_abs_logit_diff"] < 1e-4, ra["max_abs_logit_diff"]
    assert ra["control"]["max_abs_logit_diff"] > 1e-2, ra["control"]
    assert ra["max_abs_logit_diff"] == rb["max_abs_logit_diff"]
    names = sorted(p.name for p in (tmp_path / "cache" / "exports").iterdir())
    assert len(names) == 1 and names[0].endswith(".safetensors"), names
