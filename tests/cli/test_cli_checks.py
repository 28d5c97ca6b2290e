"""A check that fails never exits 0 (issue 21): for every artefact kind, a failed check is one
line naming the artefact and its figure, exit 2, nothing of the artefact written, and the patch
with report.json kept where the message says, so ``ctxc export`` retries without compiling.

``CTXC_TEST_FAIL_CHECK=KIND`` fails that kind's checks where they meet their thresholds
(``ctxc.core.checks.enforce``). A patch value scaled by 1000 is refused by its digest, and without
the digest (as an older patch) by the fidelity gate.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ctxc.backends import BACKENDS
from testbed.tiny_models import bpe_tokenizer, shared
from tests.fixtures.extras import needs_extra
from tests.fixtures.helpers import random_ids, run_cli

# kind -> (update rule, the artefact named in the message, what it would have written)
KINDS = {
    "torch": ("stable", "model/", ["model"]),
    "peft": ("stable", "adapter/", ["adapter"]),
    "lora": ("lora", "lora/", ["lora"]),
    "onnx": ("stable", "model.onnx", ["model.onnx", "model.onnx.data"]),
    "ort-adapter": ("stable", "patchable.onnx", ["context.onnx_adapter", "patchable.onnx"]),
    "gguf": ("stable", "model.gguf", ["model.gguf"]),
    "gguf-lora": ("lora", "lora.gguf", ["lora.gguf"]),
    "safetensors-delta": ("stable", "deltas.safetensors", ["deltas.safetensors"]),
}
SLOW = {"onnx", "ort-adapter"}
# The digests a patch file holds; a patch written before them has neither.
DIGESTS = ("tensors_sha256", "metadata_sha256")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama with a BPE tokenizer: every backend, GGUF included, can write it."""
    folder = tmp_path_factory.mktemp("llama")
    shared("llama").save_pretrained(str(folder))
    bpe_tokenizer().save_pretrained(str(folder))
    (folder.parent / "ctx.txt").write_text(" ".join(f"w{i}" for i in random_ids(6, 20)))
    return folder


def _compile(model_dir: Path, cwd: Path, emit: str, update: str, out: str = "out"):
    args = ["compile", "--model", str(model_dir), "--context", str(model_dir.parent / "ctx.txt")]
    return run_cli(*args, "--emit", emit, "--update", update, "--out", out, cwd=cwd)


def _ctxc_lines(stderr: str) -> list[str]:
    """ctxc's own lines of stderr (a third-party progress bar may share it: issue 20, 4)."""
    return [seg for seg in re.split(r"[\r\n]", stderr) if seg.startswith("ctxc")]


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.rglob("*") if ".partial-" in p.name or ".emit-" in p.name]


def test_every_backend_has_its_forced_failure() -> None:
    assert set(KINDS) == set(BACKENDS), f"untested: {set(BACKENDS) - set(KINDS)}"


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(
            k,
            marks=[
                pytest.mark.slow if k in SLOW else pytest.mark.tiny,
                needs_extra(BACKENDS[k].extra),
            ],
        )
        for k in KINDS
    ],
)
def test_a_forced_failure_of_each_artefact(kind, llama_dir, tmp_path, monkeypatch):
    update, artefact, writes = KINDS[kind]
    monkeypatch.setenv("CTXC_TEST_FAIL_CHECK", kind)
    run = _compile(llama_dir, tmp_path, kind, update)
    assert run.returncode == 2, run.stderr
    lines = _ctxc_lines(run.stderr)
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"ctxc: error: {artefact} check failed: "), lines
    assert lines[0].endswith(
        f"forced by CTXC_TEST_FAIL_CHECK={kind}); the patch and what passed are kept in "
        "out.failed/ (ctxc export --patch out.failed retries without compiling again)"
    ), lines
    assert not (tmp_path / "out").exists()
    kept = tmp_path / "out.failed"
    assert sorted(p.name for p in kept.iterdir()) == [".ctxc", "patch.safetensors", "report.json"]
    assert not set(writes) & {p.name for p in kept.iterdir()}
    report = json.loads((kept / "report.json").read_text())
    assert report["failed"]["artefact"] == artefact and kind not in report, report["failed"]
    assert json.loads((kept / ".ctxc").read_text())["failed"] == artefact
    assert not _leftovers(tmp_path)


@pytest.mark.tiny
@needs_extra("peft")
def test_what_passed_is_kept_and_export_retries(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CTXC_TEST_FAIL_CHECK", "peft")
    run = _compile(llama_dir, tmp_path, "torch,peft", "stable")
    assert run.returncode == 2, run.stderr
    kept = tmp_path / "out.failed"
    names = sorted(p.name for p in kept.iterdir())
    assert names == [".ctxc", "model", "patch.safetensors", "report.json"]
    report = json.loads((kept / "report.json").read_text())
    assert report["emitted_measured_on"].startswith("model/ reloaded")
    monkeypatch.delenv("CTXC_TEST_FAIL_CHECK")
    args = ["export", "--patch", "out.failed", "--model", str(llama_dir), "--to", "peft"]
    run = run_cli(*args, "--out", "adapter-out", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "adapter-out" / "adapter" / "adapter_config.json").is_file()
    # A failed export keeps the artefacts that passed (the patch is the user's own file).
    monkeypatch.setenv("CTXC_TEST_FAIL_CHECK", "peft")
    run = run_cli(*args[:-1], "torch,peft", "--out", "again", cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.splitlines()[0].endswith(
        "what passed is kept in again.failed/"
    ), run.stderr
    assert (tmp_path / "again.failed" / "config.json").is_file()
    assert not (tmp_path / "again").exists()
    run = run_cli(*args, "--out", "third", cwd=tmp_path)  # nothing passed: nothing kept
    assert run.returncode == 2 and "kept" not in run.stderr, run.stderr
    assert not list(tmp_path.glob("third*"))


@pytest.fixture(scope="module")
def scaled(tiny_model_dir, tmp_path_factory):
    """A compiled patch of the tiny Gemma 3 (whose context moves the logits by 0.69; the tiny
    Llama's by 6e-8 only), and its tensors with the largest delta's largest value scaled by
    1000 (finite)."""
    work = tmp_path_factory.mktemp("scaled")
    (work / "ctx.txt").write_text("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12")
    args = ["compile", "--model", str(tiny_model_dir), "--context", "ctx.txt", "--out", "out"]
    assert run_cli(*args, cwd=work).returncode == 0
    with safe_open(str(work / "out" / "patch.safetensors"), framework="pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(str(work / "out" / "patch.safetensors"))

    def norm(key: str) -> float:  # the delta's size: |u| |v| (or the vector's)
        other = key[:-1] + ("v" if key.endswith("::u") else "u")
        return float(tensors[key].norm() * (tensors[other].norm() if other in tensors else 1))

    name = max((k for k in tensors if not k.endswith("::v")), key=norm)
    flat = tensors[name].view(-1)
    flat[int(flat.abs().argmax())] *= 1000
    assert bool(torch.isfinite(tensors[name]).all())
    return work, tensors, meta


@pytest.mark.tiny
def test_a_scaled_value_is_refused_by_the_digest(scaled, tiny_model_dir):
    work, tensors, meta = scaled
    bad = work / "bad.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    args = ["export", "--patch", str(bad), "--model", str(tiny_model_dir), "--to", "torch"]
    run = run_cli(*args, "--out", "x", cwd=work)
    assert (run.returncode, run.stderr.splitlines()) == (
        2,
        [
            f"ctxc: error: patch {bad}: its tensors do not match the digest ctxc stored "
            "(the file was changed after it was written)"
        ],
    )
    assert not list(work.glob("x*"))


@pytest.mark.tiny
@pytest.mark.parametrize(
    ("to", "artefact"),
    [
        ("torch", "model folder"),
        pytest.param("peft", "adapter/", marks=needs_extra("peft")),
        ("safetensors-delta", "deltas.safetensors"),
    ],
)
def test_a_scaled_value_without_digest_fails_the_gate(scaled, tiny_model_dir, to, artefact):
    work, tensors, meta = scaled
    old = {k: v for k, v in meta.items() if k not in DIGESTS}  # as an older patch
    bad = work / f"old-{to}.safetensors"
    save_file(tensors, str(bad), metadata=old)
    args = ["export", "--patch", str(bad), "--model", str(tiny_model_dir), "--to", to]
    run = run_cli(*args, "--out", f"y-{to}", cwd=work)
    lines = run.stderr.splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    prefix = f"ctxc: error: {artefact} check failed: max |logit diff| from the full context"
    assert lines[0].startswith(prefix), lines
    value, limit = (float(x) for x in re.search(r" ([-+.e\d]+) > ([-+.e\d]+)", lines[0]).groups())
    assert value > 100 * limit, lines  # far off, not a rounding case
    assert not list(work.glob(f"y-{to}*"))


@pytest.mark.tiny
def test_a_patch_without_digest_still_loads(scaled):
    from ctxc.patch import Patch

    work, _, meta = scaled
    tensors = load_file(str(work / "out" / "patch.safetensors"))
    assert len(meta["tensors_sha256"]) == 64
    old = work / "older.safetensors"
    save_file(tensors, str(old), metadata={k: v for k, v in meta.items() if k not in DIGESTS})
    patch = Patch.load(old)
    assert set(patch.deltas) == set(Patch.load(work / "out").deltas)
    assert patch.meta.solver_max_abs_logit_diff == float(meta["solver_max_abs_logit_diff"])


@pytest.mark.tiny
def test_a_kept_folder_never_replaces_anything(tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "ctx.txt").write_text("w1 w2 w3 w4 w5")
    (tmp_path / "out.failed").mkdir()
    (tmp_path / "out.failed" / "mine.txt").write_text("mine")
    monkeypatch.setenv("CTXC_TEST_FAIL_CHECK", "torch")
    args = ["compile", "--model", str(tiny_model_dir), "--context", "ctx.txt", "--out", "out"]
    run = run_cli(*args, cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.splitlines()[0].endswith(
        "kept in out.failed-2/ (ctxc export --patch out.failed-2 retries without compiling again)"
    ), run.stderr
    assert sorted(p.name for p in (tmp_path / "out.failed").iterdir()) == ["mine.txt"]
    assert (tmp_path / "out.failed-2" / "patch.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ctx.txt", "out.failed", "out.failed-2"]
